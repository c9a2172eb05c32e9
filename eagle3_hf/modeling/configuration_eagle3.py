"""Configuration of the EAGLE-3 draft model.

The draft is a short stack of decoder layers (one, as in EAGLE-3, unless `num_hidden_layers` says more) that reads a
fusion of three hidden states of a frozen target model. Its config therefore holds two things: the shape of those
layers (which transformers family builds them, hidden size, heads, RoPE, depth, ...) and the identity of the target
it was trained for (hidden size, vocabulary, depth and the three tapped layers).
"""

from __future__ import annotations

import copy
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

# model_type of a target's text config -> model_type whose transformers layer classes
# build the draft layer. Mistral and Qwen2 have their own classes (Qwen2 keeps q/k/v
# biases), Qwen3 and Gemma3 bring per-head q/k norms.
SUPPORTED_LAYER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_TARGET_TO_LAYER_TYPE = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3_text",
    "gemma3": "gemma3_text",
}


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """The three taps EAGLE-3 reads: low, middle and high.

    Ids index ``output_hidden_states`` of the target, where ``hidden_states[0]`` is the
    embedding output and ``hidden_states[i]`` the residual stream entering layer ``i``.
    EAGLE-3 taps the stream entering layers 2, L//2 and L-3 (the official code, vLLM and
    speculators use these ids; SpecForge stores them minus one).
    """
    if num_target_layers < 4:
        raise ValueError(
            f"EAGLE-3 taps the target at layers 2, L//2 and L-3, which needs at least 4 target layers; "
            f"got num_target_layers={num_target_layers}."
        )
    return [2, num_target_layers // 2, num_target_layers - 3]


class Eagle3DraftConfig(PretrainedConfig):
    r"""Configuration for [`Eagle3DraftModel`].

    Args:
        vocab_size (`int`): the TARGET vocabulary size (generate() requires draft and target to agree).
        draft_vocab_size (`int`, *optional*): size of the draft's own output head; defaults to `vocab_size`.
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act,
        rms_norm_eps, rope_parameters, max_position_embeddings, attention_bias, mlp_bias:
            shape of the draft's decoder layers. `rope_parameters` are the draft's own; they are never taken
            from the target when loading a checkpoint.
        num_hidden_layers (`int`): the DRAFT's depth (not the target's, see `target_num_hidden_layers`), at least 1.
            Layer 0 reads `[embedding | fused state]` (2H wide); layers 1.. are plain decoder layers of the family
            over the layer below's output. EAGLE-3 drafts have 1.
        layer_type (`str`): the transformers `model_type` whose attention/MLP/norm classes build the layer, one of
            `SUPPORTED_LAYER_TYPES`.
        layer_config_overrides (`dict`, *optional*): extra fields for that family's layer config
            (e.g. Gemma3's `query_pre_attn_scalar`).
        target_hidden_size (`int`, *optional*): hidden size of the target; defaults to `hidden_size`.
        target_num_hidden_layers (`int`, *optional*): depth of the target.
        target_layer_ids (`list[int]`, *optional*): the three tapped layers as indices into the target's
            `output_hidden_states` (residual stream entering that layer); defaults to `[2, L//2, L-3]`.
        norm_before_residual (`bool`): residual is `hidden_norm(g)` instead of `g` (speculators' flag).
        norm_before_fc (`bool`): one RMSNorm over the concatenated taps before `fc` (`input_norm`).
        fc_norm (`bool`): an RMSNorm per tap before `fc` ("EAGLE-3.1").
        norm_output (`bool`): feed back the post-norm state instead of the pre-norm one.
        target_name_or_path, target_model_type, target_architectures: identity of the target.
        tree_depth, tree_top_k, tree_total_tokens: default draft-tree shape for generation.

    Example:

    ```python
    >>> from transformers import LlamaConfig
    >>> from eagle3_hf import Eagle3DraftConfig
    >>> target_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    ...                             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    >>> config = Eagle3DraftConfig.from_target_config(target_config, draft_vocab_size=200)
    >>> config.target_layer_ids
    [2, 4, 5]
    ```
    """

    model_type = "eagle3_draft"

    def __init__(
        self,
        vocab_size: int = 32000,
        draft_vocab_size: int | None = None,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        rope_parameters: dict[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        num_hidden_layers: int = 1,
        initializer_range: float = 0.02,
        layer_type: str = "llama",
        layer_config_overrides: dict[str, Any] | None = None,
        target_hidden_size: int | None = None,
        target_num_hidden_layers: int | None = None,
        target_layer_ids: list[int] | None = None,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
        target_name_or_path: str | None = None,
        target_model_type: str | None = None,
        target_architectures: list[str] | None = None,
        tree_depth: int = 6,
        tree_top_k: int = 8,
        tree_total_tokens: int = 32,
        **kwargs: Any,
    ) -> None:
        # Older draft configs (the official ones) carry a flat `rope_theta`.
        rope_theta = kwargs.pop("rope_theta", None)
        rope_scaling = kwargs.pop("rope_scaling", None)
        if rope_parameters is None:
            rope_parameters = dict(rope_scaling or {})
            rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
            rope_parameters["rope_theta"] = float(rope_theta if rope_theta is not None else 10000.0)
        kwargs.setdefault("tie_word_embeddings", False)
        # transformers 5.x configs no longer define the special token ids; the model reads pad_token_id.
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            kwargs.setdefault(name, None)
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // max(num_attention_heads, 1)
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters)
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range
        self.layer_type = layer_type
        self.layer_config_overrides = dict(layer_config_overrides or {})
        self.target_hidden_size = hidden_size if target_hidden_size is None else target_hidden_size
        self.target_num_hidden_layers = target_num_hidden_layers
        if target_layer_ids is None and target_num_hidden_layers is not None:
            target_layer_ids = default_target_layer_ids(target_num_hidden_layers)
        self.target_layer_ids = None if target_layer_ids is None else [int(i) for i in target_layer_ids]
        self.norm_before_residual = norm_before_residual
        self.norm_before_fc = norm_before_fc
        self.fc_norm = fc_norm
        self.norm_output = norm_output
        self.target_name_or_path = target_name_or_path
        self.target_model_type = target_model_type
        self.target_architectures = target_architectures
        self.tree_depth = tree_depth
        self.tree_top_k = tree_top_k
        self.tree_total_tokens = tree_total_tokens
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming every field whose value cannot build a working draft."""
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "tree_depth": self.tree_depth,
            "tree_top_k": self.tree_top_k,
            "tree_total_tokens": self.tree_total_tokens,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Eagle3DraftConfig.{name} must be a positive integer, got {value!r}.")
        depth = self.num_hidden_layers
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(
                f"Eagle3DraftConfig.num_hidden_layers (the draft's own depth) must be an integer >= 1, got {depth!r}."
            )
        if not isinstance(self.draft_vocab_size, int) or not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3DraftConfig.draft_vocab_size must be an integer in [1, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size!r}."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"Eagle3DraftConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.layer_type not in SUPPORTED_LAYER_TYPES:
            raise ValueError(
                f"Eagle3DraftConfig.layer_type={self.layer_type!r} is not supported; "
                f"expected one of {list(SUPPORTED_LAYER_TYPES)}."
            )
        if not isinstance(self.rope_parameters, dict) or "rope_theta" not in self.rope_parameters:
            raise ValueError(
                f"Eagle3DraftConfig.rope_parameters must be a dict with 'rope_theta', got {self.rope_parameters!r}."
            )
        if self.target_layer_ids is not None:
            ids = self.target_layer_ids
            if len(ids) != 3:
                raise ValueError(
                    f"Eagle3DraftConfig.target_layer_ids must list exactly three layers (low, mid, high), got {ids}."
                )
            depth = self.target_num_hidden_layers
            if depth is not None and not all(0 <= i <= depth for i in ids):
                raise ValueError(
                    f"Eagle3DraftConfig.target_layer_ids={ids} must index the target's output_hidden_states, "
                    f"i.e. lie in [0, target_num_hidden_layers={depth}]."
                )
        if self.tree_total_tokens < 2:
            raise ValueError(f"Eagle3DraftConfig.tree_total_tokens must be >= 2, got {self.tree_total_tokens}.")

    @property
    def uses_draft_vocab(self) -> bool:
        """True when the draft head predicts a reduced vocabulary mapped through `d2t`."""
        return self.draft_vocab_size != self.vocab_size

    def layer_config(self) -> PretrainedConfig:
        """The transformers config of `layer_type` that builds the draft layers (`num_hidden_layers` of them, so that
        attention modules take `layer_idx` 0..N-1 and a `DynamicCache` keeps one entry per layer)."""
        from eagle3_hf.modeling.families import get_family

        family = get_family(self.layer_type)
        fields: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": copy.deepcopy(self.rope_parameters),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            family.activation_field: self.hidden_act,
        }
        if family.has_mlp_bias:
            fields["mlp_bias"] = self.mlp_bias
        fields.update(family.layer_defaults(self))
        fields.update(self.layer_config_overrides)
        try:
            config = family.config_class(**fields)
        except (StrictDataclassError, TypeError, ValueError) as err:  # transformers' strict configs check shapes
            raise ValueError(
                f"Eagle3DraftConfig: its {self.layer_type} layers cannot be built: {err.__cause__ or err}"
            ) from err
        config._attn_implementation = self._attn_implementation
        return config

    @classmethod
    def from_target_config(
        cls,
        target_config: PretrainedConfig,
        draft_vocab_size: int | None = None,
        **overrides: Any,
    ) -> Eagle3DraftConfig:
        """Derive a draft config from a target's config: same width, heads and vocabulary, one layer.

        `overrides` replace any derived field (e.g. `intermediate_size`, `target_layer_ids`, or `num_hidden_layers`
        for a deeper draft; the target's own depth is `target_num_hidden_layers`).
        """
        text = target_config.get_text_config()
        model_type = getattr(text, "model_type", None)
        if model_type not in _TARGET_TO_LAYER_TYPE:
            raise ValueError(
                f"Unsupported target architecture model_type={model_type!r}; eagle3_hf supports targets of type "
                f"{sorted(_TARGET_TO_LAYER_TYPE)}."
            )
        layer_type = _TARGET_TO_LAYER_TYPE[model_type]
        rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        if "full_attention" in rope:  # per-layer-type RoPE (Gemma3): the draft layer is full attention
            rope = rope["full_attention"]
        layer_overrides: dict[str, Any] = {}
        if layer_type == "gemma3_text":
            layer_overrides["query_pre_attn_scalar"] = text.query_pre_attn_scalar
        hidden_act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
        num_heads = text.num_attention_heads
        fields: dict[str, Any] = {
            "vocab_size": text.vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            "hidden_act": hidden_act,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_parameters": {k: v for k, v in dict(rope).items() if v is not None},
            "max_position_embeddings": getattr(text, "max_position_embeddings", 2048),
            "attention_bias": bool(getattr(text, "attention_bias", False)),
            "layer_type": layer_type,
            "layer_config_overrides": layer_overrides,
            "target_hidden_size": text.hidden_size,
            "target_num_hidden_layers": text.num_hidden_layers,
            "target_name_or_path": getattr(target_config, "_name_or_path", None) or None,
            "target_model_type": model_type,
            "target_architectures": getattr(target_config, "architectures", None),
            "pad_token_id": getattr(text, "pad_token_id", None),
            "bos_token_id": getattr(text, "bos_token_id", None),
            "eos_token_id": getattr(text, "eos_token_id", None),
        }
        fields.update(overrides)
        return cls(**fields)

    def check_target_config(self, target_config: PretrainedConfig) -> None:
        """Raise `ValueError` if a target does not match the one this draft was built for."""
        text = target_config.get_text_config()
        problems = []
        if text.hidden_size != self.target_hidden_size:
            problems.append(f"hidden size {text.hidden_size} (draft expects {self.target_hidden_size})")
        if text.vocab_size != self.vocab_size:
            problems.append(f"vocabulary size {text.vocab_size} (draft expects {self.vocab_size})")
        depth = self.target_num_hidden_layers
        if depth is not None and text.num_hidden_layers != depth:
            problems.append(f"{text.num_hidden_layers} layers (draft expects {depth})")
        if self.target_layer_ids is not None and max(self.target_layer_ids) > text.num_hidden_layers:
            problems.append(
                f"no hidden state {max(self.target_layer_ids)} to tap (it has {text.num_hidden_layers} layers)"
            )
        if problems:
            name = getattr(target_config, "_name_or_path", "") or type(target_config).__name__
            raise ValueError(
                f"This draft was built for another target: the target {name!r} has " + "; ".join(problems) + "."
            )

    def resolved_target_layer_ids(self, num_target_layers: int) -> list[int]:
        """The tap ids, filling the default from the target's depth when the config has none."""
        return (
            list(self.target_layer_ids)
            if self.target_layer_ids is not None
            else default_target_layer_ids(num_target_layers)
        )


__all__ = ["Eagle3DraftConfig", "SUPPORTED_LAYER_TYPES", "default_target_layer_ids"]
