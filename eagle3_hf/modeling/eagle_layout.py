"""The official SafeAILab / SpecForge layout (``LlamaForCausalLMEagle3``, weights under ``midlayer.*``): its config,
read into ours and written from ours.

A one-layer Llama config with ``draft_vocab_size``; SpecForge adds ``fc_norm``, ``head_dim``, rope fields,
``target_hidden_size`` and tap ids in the output-of-layer convention (ours minus one). Detecting the layout and
writing its files live in `eagle3_hf.modeling.layouts`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.layout_fields import common_fields, layer_fields

__all__ = ["EAGLE_ARCHITECTURES", "eagle_config_dict", "eagle_config_kwargs", "eagle_export_problems"]

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle_config_kwargs(config: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """`Eagle3DraftConfig` arguments for an official SafeAILab / SpecForge checkpoint (keys already normalised)."""
    keys = set(keys)
    fields = layer_fields(config, "official/SpecForge draft")
    fields["draft_vocab_size"] = config.get("draft_vocab_size") or config.get("truncated_vocab_size")
    fields["target_hidden_size"] = config.get("target_hidden_size")
    # Biases: the official model has none whatever the config says; trust what was saved.
    fields["attention_bias"] = "midlayer.self_attn.q_proj.bias" in keys
    fields["mlp_bias"] = "midlayer.mlp.gate_proj.bias" in keys
    fields["fc_norm"] = bool(config.get("fc_norm", any(k.startswith("fc_norm.") for k in keys)))
    # SpecForge's `norm_output` only means "norm before lm_head" (always done): not our flag.
    taps = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if taps is not None:
        fields["target_layer_ids"] = [int(i) + 1 for i in taps]  # output-of-layer -> input-of-layer ids
    fields["layer_type"] = "llama"
    return fields


def eagle_export_problems(config: Eagle3DraftConfig) -> list[str]:
    """What in `config` the official/SpecForge layout cannot express, each with the reason (empty: nothing)."""
    problems = []
    if config.num_hidden_layers != 1:
        problems.append(f"num_hidden_layers={config.num_hidden_layers} (it holds one decoder layer; save a deeper "
                        "draft in the native or speculators layout)")  # fmt: skip
    if config.layer_type != "llama":
        problems.append(f"layer_type={config.layer_type!r} (the layout builds a Llama layer)")
    for flag in ("norm_before_residual", "norm_before_fc", "norm_output"):
        if getattr(config, flag):
            problems.append(f"{flag}=True")
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
    if config.target_layer_ids is not None:
        # SpecForge convention: output-of-layer ids, ours minus one.
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.target_layer_ids]}
    return out
