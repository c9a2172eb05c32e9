"""The official SafeAILab / SpecForge layout (``LlamaForCausalLMEagle3``, weights under ``midlayer.*``): its config,
read into ours the way the servers that run such a checkpoint read it, and written from ours so that they read it back
as the same draft.

vLLM and SGLang serve this layout, SpecForge trains and exports it (snapshots of 2026; the table per field is in
docs/checkpoints.md). Where they read a field differently, or a producer meant something else by it in an earlier
version, the loader takes the current servers' reading and warns naming the value, unless the caller chose one of the
readings (`load_draft`'s ``norm_output=`` / ``target_layer_ids=``); an exporter writes only what every reader takes
for the same draft, and refuses the rest with the reason. Detecting the layout and writing its files live in
`eagle3_hf.modeling.layouts`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.layout_fields import (
    NORM_PAIR,
    check_tap_count,
    choose_reading,
    common_fields,
    layer_fields,
    three_taps,
)

__all__ = ["EAGLE_ARCHITECTURES", "eagle_config_dict", "eagle_config_kwargs", "eagle_export_problems"]

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WHERE = "official/SpecForge"
# What norm_output meant to whom (SpecForge PR #879 of September 2026 gave it the servers' meaning).
_EAGLE31 = "vLLM, SGLang, TensorRT-LLM and SpecForge since its PR #879 (EAGLE-3.1: the post-norm state fed back)"
_SPECFORGE_BEFORE_879 = "SpecForge from July 2026 until its PR #879 (EAGLE-3: the pre-norm state fed back)"
_EAGLE3 = "vLLM, SGLang, TensorRT-LLM and SpecForge since its PR #879 (EAGLE-3: the pre-norm state fed back)"
_SPECFORGE_BEFORE_879_FALSE = "SpecForge from July 2026 until its PR #879"
_NEW_SGLANG = "SGLang since its PR #25454 (input-of-layer ids: a first id other than 1 is taken as it is)"
_OLD_READERS = "SGLang before its PR #25454 and SpecForge (output-of-layer ids, ours minus one)"


def eagle_config_kwargs(
    config: dict[str, Any], keys: Iterable[str], reading: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`Eagle3DraftConfig` arguments for an official SafeAILab / SpecForge checkpoint (keys already normalised).

    Args:
        config: its ``config.json``.
        keys: its weight names, under our names.
        reading: the caller's choice for a field the checkpoint states ambiguously (``norm_output``,
            ``target_layer_ids``); a choice that is not one of its readings raises `ValueError` naming both.
    """
    keys, reading = set(keys), dict(reading or {})
    eagle = config.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ValueError(f"eagle_config must be a mapping, got {eagle!r}.")
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError(
            "eagle_config.use_aux_hidden_state=false: this draft reads no target taps (no fc); "
            "eagle3_hf drafts always fuse three."
        )
    fields = layer_fields(config, f"{WHERE} draft")
    fields["draft_vocab_size"] = config.get("draft_vocab_size") or config.get("truncated_vocab_size")
    fields["target_hidden_size"] = config.get("target_hidden_size")
    # Biases: the official model has none whatever the config says; trust what was saved.
    fields["attention_bias"] = "midlayer.self_attn.q_proj.bias" in keys
    fields["mlp_bias"] = "midlayer.mlp.gate_proj.bias" in keys
    fields["fc_norm"] = _fc_norm(config, keys)
    fields["norm_before_fc"] = _norm_before_fc(config, eagle)
    if fields["fc_norm"] and fields["norm_before_fc"]:
        raise ValueError(f"The {WHERE} config sets {NORM_PAIR}.")
    fields["norm_before_residual"] = _norm_before_residual(config)
    fields["norm_output"] = _norm_output(config, reading.get("norm_output"))
    check_tap_count(config.get("num_aux_hidden_states"), WHERE)
    taps = _taps(config, eagle, reading.get("target_layer_ids"))
    if taps is not None:
        fields["target_layer_ids"] = taps
    fields["layer_type"] = "llama"
    return fields


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)


def _fc_norm(config: dict[str, Any], keys: set[str]) -> bool:
    """vLLM reads ``fc_norm``; SGLang and SpecForge also the older ``use_aux_norm`` (weights ``aux_norm_{low,mid,
    high}``, which `normalize_key` maps to ``fc_norm.{0,1,2}``)."""
    stated = config.get("fc_norm", config.get("use_aux_norm"))
    if stated is None and any(k.startswith("fc_norm.") for k in keys):
        # Loaded with them, as before; but neither server builds the norms without the flag.
        _warn(
            f"The {WHERE} checkpoint holds fc_norm.* weights but its config.json has no fc_norm: applying them "
            "(as trained), but vLLM and SGLang would not (SGLang drops the weights without a word): add "
            '"fc_norm": true to its config.json before serving it.'
        )
        return True
    return bool(stated or config.get("use_aux_norm"))


def _norm_before_fc(config: dict[str, Any], eagle: dict[str, Any]) -> bool:
    """vLLM reads ``eagle_config.norm_before_fc``, else the top-level one (NVIDIA's checkpoints state both)."""
    inner, outer = eagle.get("norm_before_fc"), config.get("norm_before_fc")
    if inner is not None and outer is not None and bool(inner) != bool(outer):
        raise ValueError(
            f"The {WHERE} config has eagle_config.norm_before_fc={inner!r} but norm_before_fc={outer!r}; "
            "vLLM reads the first, so they must agree."
        )
    value = bool(inner if inner is not None else outer)
    if value:
        _warn(
            f"The {WHERE} config sets norm_before_fc: true, which vLLM and SGLang since its PR #32334 apply (and so "
            "does this load), but SpecForge has no such norm and SGLang before that PR drops it: those run this "
            "draft without it."
        )
    return value


def _norm_before_residual(config: dict[str, Any]) -> bool:
    """vLLM reads it from any config; SGLang and SpecForge never apply it (their residual is the un-normed state)."""
    value = bool(config.get("norm_before_residual", False))
    if value:
        _warn(
            f"The {WHERE} config sets norm_before_residual: true, which vLLM applies (and so does this load), but "
            "SGLang and SpecForge do not: SGLang runs this draft with the un-normed residual."
        )
    return value


def _norm_output(config: dict[str, Any], given: bool | None) -> bool:
    """``norm_output: true`` is EAGLE-3.1 to the servers and to SpecForge since its PR #879, EAGLE-3 to SpecForge
    before it. Absent is EAGLE-3 to every reader of every version (SpecForge's default was true, meaning that). An
    explicit false is EAGLE-3 to the servers and to SpecForge since PR #879, but SpecForge before it trained such a
    draft with lm_head over the un-normed state, which no server runs and no reading here builds: loaded as the
    servers read it, with a warning naming the other reading unless the caller chose false."""
    stated = config.get("norm_output")
    if stated not in (None, True, False):
        raise ValueError(f"The {WHERE} config has norm_output={stated!r}; expected true, false or no such field.")
    what = f"the {WHERE} config's norm_output={stated!r}"
    if stated is None:
        return choose_reading("norm_output", [(False, "every reader")], given, what)
    if stated is False:
        value = choose_reading("norm_output", [(False, _EAGLE3)], given, what)
        if given is None:
            _warn(
                f"The {WHERE} config's norm_output=False: read as norm_output=False, the way {_EAGLE3} read it; "
                f"{_SPECFORGE_BEFORE_879_FALSE} read it as lm_head over the un-normed state, a draft no server runs: "
                "one trained there drafts here (and on every server) otherwise than it was trained. Pass "
                "norm_output=False to from_pretrained (eagle3-hf train: --norm-output false) to silence this warning."
            )
        return value
    return choose_reading("norm_output", [(True, _EAGLE31), (False, _SPECFORGE_BEFORE_879)], given, what, _warn)


def _taps(config: dict[str, Any], eagle: dict[str, Any], given: list[int] | None) -> list[int] | None:
    """vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` (input-of-layer ids, ours), else the one in
    ``eagle_config``; SGLang and SpecForge only ``eagle_config``'s, as output-of-layer ids (ours minus one), except
    that SGLang since its PR #25454 takes them as input-of-layer ids unless the first is 1. Neither present: every
    reader taps 2, L//2, L-3 (our default)."""
    outer, inner = config.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
    readings: list[tuple[list[int], str]] = []
    if inner is not None:
        ids = three_taps(inner, f"{WHERE} eagle_config.eagle_aux_hidden_state_layer_ids")
        plus_one = [i + 1 for i in ids]
        readings = (
            [(plus_one, "SGLang and SpecForge (output-of-layer ids)")]
            if ids[0] == 1
            else [(ids, _NEW_SGLANG), (plus_one, _OLD_READERS)]
        )
    if outer is not None:
        ids = three_taps(outer, f"{WHERE} eagle_aux_hidden_state_layer_ids")
        if readings and ids not in [r for r, _ in readings]:
            raise ValueError(
                f"The {WHERE} config has eagle_aux_hidden_state_layer_ids={ids}, which vLLM reads, and "
                f"eagle_config.eagle_aux_hidden_state_layer_ids={inner}, which SGLang reads as "
                f"{' or '.join(str(r) for r, _ in readings)} (input-of-layer ids): they must name the same taps."
            )
        readings = [(ids, "vLLM (top-level, input-of-layer ids)")] + [r for r in readings if r[0] != ids]
    if not readings:
        if given is not None:
            raise ValueError(
                f"target_layer_ids={given} was passed, but the {WHERE} checkpoint names no taps: every "
                "reader taps 2, L//2, L-3 (the default)."
            )
        return None
    what = f"the {WHERE} config's tap ids (eagle_aux_hidden_state_layer_ids={outer}, eagle_config's {inner})"
    return choose_reading("target_layer_ids", readings, given, what, _warn)


def eagle_export_problems(config: Eagle3DraftConfig) -> list[str]:
    """What in `config` the official/SpecForge layout cannot state so that every reader runs the same draft, each
    with the reason (empty: nothing)."""
    problems = []
    if config.num_hidden_layers != 1:
        problems.append(
            f"num_hidden_layers={config.num_hidden_layers} (it holds one decoder layer; save a deeper "
            "draft in the native or speculators layout)"
        )
    if config.layer_type != "llama":
        problems.append(f"layer_type={config.layer_type!r} (the layout builds a Llama layer)")
    if config.norm_before_residual:
        problems.append(
            "norm_before_residual=True (vLLM applies it, SGLang and SpecForge do not; save in the "
            "speculators layout, which vLLM serves)"
        )
    if config.norm_before_fc:
        problems.append(
            "norm_before_fc=True (vLLM and SGLang since its PR #32334 apply it, but SpecForge has no such norm "
            "and SGLang before that PR drops input_norm.weight without a word; save in the speculators layout, "
            "which vLLM serves)"
        )
    ids = config.target_layer_ids
    if ids is not None and ids[0] != 2:
        problems.append(
            f"target_layer_ids={ids} (SGLang reads the layout's output-of-layer ids as such only when the "
            "first is 1, i.e. a first tap of 2, and reads any other one layer apart since its PR #25454 "
            "from before it; save in the native or speculators layout)"
        )
    return problems


def eagle_config_dict(config: Eagle3DraftConfig, dtype_name: str, include_embedding: bool) -> dict[str, Any]:
    """The ``config.json`` of the official/SpecForge layout (``LlamaForCausalLMEagle3``); the caller has checked
    `eagle_export_problems`."""
    out = {"architectures": [EAGLE_ARCHITECTURES[0]], "model_type": "llama", **common_fields(config, dtype_name)}
    out["mlp_bias"] = config.mlp_bias
    out["draft_vocab_size"] = config.draft_vocab_size
    # The official loader reads the presence of target_hidden_size as "the embedding is in this checkpoint" and
    # otherwise copies the target's: write it only when that holds.
    if include_embedding or config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    if config.fc_norm:
        out["fc_norm"] = True
    # Only true is written: absent is EAGLE-3 to every reader, an explicit false was something else to SpecForge
    # before its PR #879 (lm_head over the un-normed state).
    if config.norm_output:
        out["norm_output"] = True
    if config.target_layer_ids is not None:
        # vLLM reads the top-level ids (ours); SGLang and SpecForge eagle_config's, output-of-layer ids (ours minus
        # one, its first 1: read so by SGLang before and after its PR #25454).
        out["eagle_aux_hidden_state_layer_ids"] = list(config.target_layer_ids)
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.target_layer_ids]}
    return out
