"""Which transformers classes build the draft layers for each supported target family.

The draft layers are assembled from the family's own attention, MLP and RMSNorm classes
(never a forked modeling file); only the first layer's q/k/v projections are widened to
read the 2H-wide [embedding | hidden] input. RoPE uses transformers' Llama rotary embedding for
every family: the rotation is the same and the draft keeps one set of RoPE parameters.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class LayerFamily:
    model_type: str
    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # class-name prefix, e.g. "Qwen3"
    config_name: str
    activation_field: str = "hidden_act"
    has_mlp_bias: bool = True
    extra_defaults: Callable[[Any], dict[str, Any]] = field(default=lambda cfg: {})

    def _modeling(self) -> Any:
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    @property
    def config_class(self) -> type:
        mod = importlib.import_module(f"transformers.models.{self.module}.configuration_{self.module}")
        return getattr(mod, self.config_name)

    @property
    def attention_class(self) -> type[nn.Module]:
        return getattr(self._modeling(), f"{self.prefix}Attention")

    @property
    def mlp_class(self) -> type[nn.Module]:
        return getattr(self._modeling(), f"{self.prefix}MLP")

    @property
    def norm_class(self) -> type[nn.Module]:
        return getattr(self._modeling(), f"{self.prefix}RMSNorm")

    def layer_defaults(self, draft_config: Any) -> dict[str, Any]:
        return self.extra_defaults(draft_config)


def _full_attention_layers(cfg: Any) -> dict[str, Any]:
    # The draft layers always attend to their whole (short) context: no sliding window.
    return {"layer_types": ["full_attention"] * cfg.num_hidden_layers}


def _gemma3_defaults(cfg: Any) -> dict[str, Any]:
    return {**_full_attention_layers(cfg), "query_pre_attn_scalar": cfg.head_dim}


_FAMILIES = {
    "llama": LayerFamily("llama", "llama", "Llama", "LlamaConfig"),
    "mistral": LayerFamily("mistral", "mistral", "Mistral", "MistralConfig", has_mlp_bias=False),
    "qwen2": LayerFamily(
        "qwen2", "qwen2", "Qwen2", "Qwen2Config", has_mlp_bias=False, extra_defaults=_full_attention_layers
    ),
    "qwen3": LayerFamily(
        "qwen3", "qwen3", "Qwen3", "Qwen3Config", has_mlp_bias=False, extra_defaults=_full_attention_layers
    ),
    "gemma3_text": LayerFamily(
        "gemma3_text",
        "gemma3",
        "Gemma3",
        "Gemma3TextConfig",
        activation_field="hidden_activation",
        has_mlp_bias=False,
        extra_defaults=_gemma3_defaults,
    ),
}


def get_family(layer_type: str) -> LayerFamily:
    if layer_type not in _FAMILIES:
        raise ValueError(f"Unsupported draft layer_type {layer_type!r}; expected one of {sorted(_FAMILIES)}.")
    return _FAMILIES[layer_type]
