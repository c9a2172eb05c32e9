"""Config and key translation between our native draft layout and the external EAGLE-3 layouts.

Three checkpoint layouts exist in the wild (details in the design notes, reference §2):

* ``native``: our `Eagle3DraftConfig` (model_type ``eagle3_draft``) and the model's own state-dict keys.
* ``eagle``: the official SafeAILab checkpoints and SpecForge exports: a one-layer Llama config with
  ``draft_vocab_size`` and weights under ``midlayer.*`` (one decoder layer only). SpecForge adds ``fc_norm``,
  ``head_dim``, rope fields, ``target_hidden_size`` and tap ids in the output-of-layer convention (ours minus one).
* ``speculators``: vLLM's speculators: ``speculators_model_type`` + a nested ``transformer_layer_config``, norm
  flags, tap ids in our (input-of-layer) convention, weights under ``layers.{i}.*`` for its
  ``transformer_layer_config.num_hidden_layers`` layers (``layers.0`` is our ``midlayer``, see `layer_keys`).

This module detects the layout, maps key names and the speculators config, and writes the external layouts
(`save_speculators`, `save_eagle`); the official/SpecForge config is read and written by
`eagle3_hf.modeling.eagle_layout`, the fields both share by `eagle3_hf.modeling.layout_fields`. Reading files and
loading a draft from any layout live in `eagle3_hf.modeling.checkpoint_files` and `eagle3_hf.modeling.checkpoints`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.eagle_layout import (  # noqa: F401  (eagle_config_kwargs: re-exported)
    EAGLE_ARCHITECTURES,
    eagle_config_dict,
    eagle_config_kwargs,
    eagle_export_problems,
)
from eagle3_hf.modeling.embedding import resolve_include_embedding, stored_embedding
from eagle3_hf.modeling.identity import target_identity
from eagle3_hf.modeling.layer_keys import from_numbered, to_numbered
from eagle3_hf.modeling.layout_fields import NORM_PAIR, check_tap_count, common_fields, layer_fields, three_taps
from eagle3_hf.utils.hub import is_hub_id  # noqa: F401  (is_hub_id: re-exported)

NATIVE, SPECULATORS, EAGLE = "native", "speculators", "eagle"
LAYOUTS = (NATIVE, SPECULATORS, EAGLE)
# Layer families speculators can build (transformer_layer_config.model_type).
SPECULATORS_LAYER_TYPES = ("llama", "qwen3")
_SPECULATORS_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The speculators release whose config format `speculators_config_dict` writes: 0.7.0 is the first whose
# Eagle3SpeculatorConfig defines every field written here (fc_norm and norm_output arrived in it, norm_before_fc and
# qwen3 layers before). speculators records its own version in this field when it saves, and an older reader keeps
# flags it does not know without applying them, building another model without a word.
SPECULATORS_VERSION = "0.7.0"
# Prefixes some exports put in front of every key (a wrapper module's attribute name).
_KEY_PREFIXES = ("draft_model.", "model.")
# SpecForge's and SGLang's older names of the per-tap norms (with `use_aux_norm`, their older name of `fc_norm`).
_LEGACY_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}
CONFIG_NAME = "config.json"
EMBED_KEY = "embed_tokens.weight"


def normalize_key(key: str) -> str:
    """Map an external weight name to our state-dict name: strip wrapper prefixes, ``layers.0.`` -> ``midlayer.``,
    ``layers.{i}.`` -> ``upper_layers.{i-1}.``, ``aux_norm_{low,mid,high}.`` -> ``fc_norm.{0,1,2}.``."""
    for prefix in _KEY_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    for old, new in _LEGACY_NAMES.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return from_numbered(key)


def detect_layout(config: dict[str, Any], keys: Iterable[str]) -> str:
    """Which layout a checkpoint uses: ``"native"``, ``"eagle"`` (official/SpecForge) or ``"speculators"``.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        keys: the weight names found in its weights file(s).
    """
    if not isinstance(config, dict):
        raise ValueError(f"Expected the checkpoint's config.json as a dict, got {type(config).__name__}.")
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise ValueError(
                f"This is a speculators checkpoint of type speculators_model_type={kind!r}; only 'eagle3' drafts "
                "can be loaded."
            )
        return SPECULATORS
    model_type = config.get("model_type")
    if model_type == Eagle3DraftConfig.model_type:
        return NATIVE
    architectures = list(config.get("architectures") or [])
    if any(arch in EAGLE_ARCHITECTURES for arch in architectures):
        return EAGLE
    keys = list(keys)
    names = {normalize_key(k) for k in keys}
    # A full model's `model.layers.0.*` also normalises to `midlayer.*`: only one layer and no `layers.1` is a draft.
    one_layer = not any(".layers.1." in f".{k}" for k in keys)
    has_draft_keys = "fc.weight" in names or (one_layer and any(k.startswith("midlayer.") for k in names))
    if "LlamaForCausalLM" in architectures and config.get("num_hidden_layers", 1) == 1 and has_draft_keys:
        return EAGLE
    depth = config.get("num_hidden_layers")
    if isinstance(depth, int) and depth > 1 and not has_draft_keys:
        raise ValueError(
            f"This is a full model ({', '.join(architectures) or model_type}, {depth} layers), not an EAGLE-3 draft: "
            "pass it as the target (--target), and a draft checkpoint as the draft."
        )
    raise ValueError(
        f"Cannot tell which EAGLE-3 checkpoint layout this is (model_type={model_type!r}, "
        f"architectures={architectures}, fc/midlayer weights {'present' if has_draft_keys else 'absent'}). Accepted: "
        f"native (model_type {Eagle3DraftConfig.model_type!r}); speculators (speculators_model_type 'eagle3'); "
        f"official/SpecForge (architectures {list(EAGLE_ARCHITECTURES)}, or a one-layer LlamaForCausalLM with "
        "fc.weight / midlayer.* weights)."
    )


def speculators_config_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`Eagle3DraftConfig` arguments for a speculators ``eagle3`` checkpoint."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(
            f"A speculators eagle3 config needs a transformer_layer_config mapping, got {type(layer).__name__}."
        )
    layer_type = layer.get("model_type")
    if layer_type not in SPECULATORS_LAYER_TYPES:
        raise ValueError(
            f"transformer_layer_config.model_type={layer_type!r} is not supported; expected one of "
            f"{list(SPECULATORS_LAYER_TYPES)}."
        )
    fields = layer_fields(layer, "speculators transformer_layer_config", deep=True)
    fields["layer_type"] = layer_type
    fields["attention_bias"] = bool(layer.get("attention_bias", False))
    fields["mlp_bias"] = bool(layer.get("mlp_bias", False))
    fields["draft_vocab_size"] = config.get("draft_vocab_size")
    fields["target_hidden_size"] = config.get("target_hidden_size")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        fields[flag] = bool(config.get(flag, False))
    fields["norm_before_residual"] = _speculators_norm_before_residual(config)
    if fields["fc_norm"] and fields["norm_before_fc"]:
        raise ValueError(f"The speculators config sets {NORM_PAIR}.")
    check_tap_count(config.get("num_aux_hidden_states"), "speculators")
    taps = config.get("eagle_aux_hidden_state_layer_ids")
    if taps is not None:  # already input-of-layer ids, as vLLM reads them
        fields["target_layer_ids"] = three_taps(taps, "speculators eagle_aux_hidden_state_layer_ids")
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    fields["target_name_or_path"] = verifier.get("name_or_path") or None
    fields["target_architectures"] = list(verifier.get("architectures") or []) or None
    return fields


def _speculators_norm_before_residual(config: dict[str, Any]) -> bool:
    """vLLM reads a speculators config without ``norm_before_residual`` as True (its default for this layout, unlike
    speculators' own class, whose default is False): loaded as the server runs it, with a warning naming the
    assumption. Every config `save_speculators` writes states the field."""
    if "norm_before_residual" in config:
        return bool(config["norm_before_residual"])
    warnings.warn(
        "The speculators config has no norm_before_residual: read as norm_before_residual=True (the residual is "
        "hidden_norm(g)), the way vLLM reads it; speculators' own config class defaults to False. Add the field "
        "to the config.json to state which the draft was trained with.",
        UserWarning,
        stacklevel=4,
    )
    return True


def check_exportable(config: Eagle3DraftConfig, layout: str) -> None:
    """Raise `ValueError` if `layout` cannot describe this draft exactly (never write a different model)."""
    problems = []
    if config.layer_config_overrides:
        problems.append(f"layer_config_overrides={config.layer_config_overrides}")
    if layout == EAGLE:
        problems += eagle_export_problems(config)
    elif layout == SPECULATORS:
        if config.layer_type not in SPECULATORS_LAYER_TYPES:
            problems.append(f"layer_type={config.layer_type!r} (expected one of {list(SPECULATORS_LAYER_TYPES)})")
        if config.fc_norm and config.norm_before_fc:
            problems.append(NORM_PAIR)
    if problems:
        name = "official/SpecForge" if layout == EAGLE else layout
        raise ValueError(f"The {name} layout cannot express this draft: " + "; ".join(problems) + ".")


def speculators_config_dict(
    config: Eagle3DraftConfig, dtype_name: str, speculative_tokens: int, target_id: str | None = None
) -> dict[str, Any]:
    """The ``config.json`` of the speculators layout (``Eagle3Speculator``); see `target_identity` for `target_id`."""
    name, architectures = target_identity(config, target_id)
    check_exportable(config, SPECULATORS)
    layer = {
        "architectures": [_SPECULATORS_ARCHITECTURE[config.layer_type]],
        "model_type": config.layer_type,
        **common_fields(config, dtype_name),
    }
    if config.layer_type == "llama":
        layer["mlp_bias"] = config.mlp_bias
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": config.target_layer_ids,
        "embed_requires_grad": False,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": architectures},
        },
        "torch_dtype": dtype_name,
    }


# ------------------------------------------------------------------------------------------------
# writing files


def _export_tensors(draft: Any, include_embedding: bool, numbered: bool) -> dict[str, torch.Tensor]:
    """The draft's tensors under the layout's names: ours, or with `numbered` layers ``layers.{i}.*``; the embedding
    in the dtype it came in (`stored_embedding`), bit for bit."""
    tensors = {}
    for key, tensor in draft.state_dict().items():
        if key == EMBED_KEY:
            if not include_embedding:
                continue
            tensor = stored_embedding(draft)
        tensors[to_numbered(key) if numbered else key] = tensor.detach().cpu().contiguous()
    return tensors


def _write(out_dir: str | os.PathLike, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _dtype_name(draft: Any) -> str:
    return str(draft.fc.weight.dtype).removeprefix("torch.")


def save_speculators(
    draft: Any,
    out_dir: str | os.PathLike,
    include_embedding: bool | None = None,
    target_id: str | None = None,
    embedding: torch.Tensor | None = None,
) -> str:
    """Write `draft` in the speculators layout (``Eagle3Speculator`` config, ``layers.{i}.*`` weights, safetensors)
    and return the verifier it records (``speculators_config.verifier.name_or_path``).

    The embedding is always written, in the dtype it came in (`stored_embedding`): speculators fills a missing one
    with zeros without a word. A draft without one raises `ValueError` (load it with its target). `embedding` (the
    target's own input embedding) is written in its own dtype instead of the draft's copy. `target_id` names the
    verifier instead of what the draft records: a Hub id, which speculators fetches from the Hub, or a local folder
    holding the target (config.json and weights), which it loads offline (see `target_identity`). Raises
    `ValueError` if the draft's layer type is not one speculators builds (llama, qwen3), or if it sets both fc_norm
    and norm_before_fc (`NORM_PAIR`).
    """
    if include_embedding is False or (embedding is None and not draft.embedding_loaded):
        raise ValueError(
            "The speculators layout must carry the token embedding (speculators would load zeros in its place), but "
            + (
                "include_embedding=False was passed"
                if include_embedding is False
                else "this draft has none (its checkpoint left it out)"
            )
            + ": load the draft with its target (from_pretrained(path, target=target), or `eagle3-hf convert SRC "
            "DST --to speculators --target NAME_OR_PATH`)."
        )
    config = speculators_config_dict(
        draft.config, _dtype_name(draft), speculative_tokens=draft.config.tree_depth, target_id=target_id
    )
    tensors = _export_tensors(draft, True, numbered=True)
    if embedding is not None:
        if tuple(embedding.shape) != tuple(tensors[EMBED_KEY].shape):
            raise ValueError(
                f"The embedding given has shape {tuple(embedding.shape)}, the draft's is "
                f"{tuple(tensors[EMBED_KEY].shape)}."
            )
        tensors[EMBED_KEY] = embedding.detach().cpu().contiguous()
    _write(out_dir, config, tensors)
    return str(config["speculators_config"]["verifier"]["name_or_path"])


def save_eagle(draft: Any, out_dir: str | os.PathLike, include_embedding: bool = False) -> None:
    """Write `draft` in the official SafeAILab / SpecForge layout (``LlamaForCausalLMEagle3``, ``midlayer.*``).

    Like the official training code, the embedding is left out unless `include_embedding` (then written in the dtype
    it came in, `stored_embedding`). A consumer converting a file without it onward must supply the target's
    embedding: `speculators convert` loads zeros in its place without a word. An EAGLE-3.1 draft (``fc_norm``,
    ``norm_output``) is written as vLLM, SGLang and SpecForge since its PR #879 read it. Raises `ValueError` for a
    draft its readers would not all run the same (`eagle_export_problems`: more than one decoder layer,
    norm_before_residual, norm_before_fc, a first tap other than 2, a non-Llama layer) and for one whose hidden size
    differs from the target's without its own embedding (the target's cannot stand in).
    """
    include = resolve_include_embedding(draft, include_embedding)
    config = draft.config
    if not include and config.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"This draft's hidden_size={config.hidden_size} differs from target_hidden_size="
            f"{config.target_hidden_size}, so the target's embedding cannot stand in for its own: pass "
            "include_embedding=True."
        )
    check_exportable(config, EAGLE)
    out_config = eagle_config_dict(config, _dtype_name(draft), include)
    _write(out_dir, out_config, _export_tensors(draft, include, numbered=False))
