"""What every external EAGLE-3 layout shares: a flat Llama/Qwen3-style layer config (read and written), the three
target taps, and how a field that readers take in more than one way is resolved.

The official/SpecForge layout (`eagle3_hf.modeling.eagle_layout`) is such a config at its top level; speculators
(`eagle3_hf.modeling.layouts`) nests one as its ``transformer_layer_config``. Both read RoPE from the checkpoint
itself, never from a target (reference §1 and §6.3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig

__all__ = [
    "NORM_PAIR",
    "check_tap_count",
    "choose_reading",
    "common_fields",
    "layer_fields",
    "required",
    "rope_legacy",
    "rope_parameters_from",
    "three_taps",
]

_DEFAULT_ROPE_THETA = 10000.0
# Both fusion norms: this package applies the per-tap ones first, vLLM the joint one first, speculators neither.
NORM_PAIR = (
    "fc_norm=True with norm_before_fc=True (speculators refuses the pair, vLLM applies input_norm before the "
    "per-tap norms and eagle3_hf after them, so no reader runs the same draft)"
)


def required(config: dict[str, Any], names: Iterable[str], where: str) -> None:
    """Raise `ValueError` naming the fields of `names` that `config` lacks (or holds as null)."""
    missing = [n for n in names if config.get(n) is None]
    if missing:
        raise ValueError(f"The {where} config lacks required field(s) {missing}.")


def rope_parameters_from(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters from a flat HF config: v5 ``rope_parameters``, else ``rope_theta``/``rope_scaling``.

    The default θ is 10000, what the official inference code uses when the draft config has none (never the
    target's θ: the official training code ignored it too, reference §1 and §6.3).
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and "full_attention" not in params:
        params = dict(params)
    else:
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling must be a mapping or null, got {scaling!r}.")
        params = {k: v for k, v in scaling.items() if k != "type"}
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if params.get("rope_theta") is None:
        theta = config.get("rope_theta")
        params["rope_theta"] = float(theta) if theta is not None else _DEFAULT_ROPE_THETA
    params.setdefault("rope_type", "default")
    return params


def layer_fields(config: dict[str, Any], where: str, deep: bool = False) -> dict[str, Any]:
    """The layers' shape from a flat Llama/Qwen3-style config; `deep`: the layout may hold more than one layer."""
    required(config, ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"), where)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    depth = config.get("num_hidden_layers", 1)
    if deep and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(f"The {where} config has num_hidden_layers={depth!r}; expected an integer >= 1.")
    if not deep and depth != 1:
        raise ValueError(
            f"The {where} config has num_hidden_layers={depth}; drafts in this layout have exactly 1 decoder layer."
        )
    return {
        "num_hidden_layers": depth,
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        # The official code ignores head_dim (uses H/nh); SpecForge and speculators honour it.
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "hidden_act": config.get("hidden_act", "silu"),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_parameters": rope_parameters_from(config),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "pad_token_id": config.get("pad_token_id"),
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
    }


def rope_legacy(rope: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) in the flat pre-v5 form that the official and speculators readers expect."""
    theta = float(rope["rope_theta"])
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling["type"] = rope_type  # the official cnets.py reads rope_scaling["type"]
    return theta, scaling


def common_fields(config: Eagle3DraftConfig, dtype_name: str) -> dict[str, Any]:
    """The flat layer config of `config` that both external layouts write."""
    theta, scaling = rope_legacy(config.rope_parameters)
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "vocab_size": config.vocab_size,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def check_tap_count(count: Any, where: str) -> None:
    """Raise `ValueError` unless `count` (``num_aux_hidden_states``: vLLM and SGLang size ``fc`` by it) is absent or
    3, the taps an eagle3_hf draft fuses."""
    if count is not None and count != 3:
        raise ValueError(
            f"The {where} config has num_aux_hidden_states={count!r}; eagle3_hf drafts fuse exactly 3 target taps."
        )


def three_taps(ids: Any, where: str) -> list[int]:
    """`ids` as a list of three non-negative integers, else `ValueError` naming it."""
    if (
        not isinstance(ids, (list, tuple))
        or len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ValueError(
            f"The {where} are {ids!r}; expected three non-negative layer ids (eagle3_hf drafts fuse "
            "exactly 3 target taps)."
        )
    return [int(i) for i in ids]


def choose_reading(
    name: str,
    readings: list[tuple[Any, str]],
    given: Any,
    what: str,
    warn: Callable[[str], None] | None = None,
) -> Any:
    """The value a checkpoint's field is read as: the caller's choice `given` when it is one of the `readings`
    ``(value, who reads it so)``, else `ValueError` naming both; without a choice the first reading (the servers'),
    with a `warn`ing naming the others when there are several."""
    values = [value for value, _ in readings]
    said = " or ".join(f"{name}={value!r} ({who})" for value, who in readings)
    if given is not None:
        if given not in values:
            raise ValueError(f"{name}={given!r} was passed, but {what} can be read only as {said}.")
        return given
    if len(readings) > 1 and warn is not None:
        (first, who), others = readings[0], readings[1:]
        warn(
            f"{what[0].upper()}{what[1:]}: read as {name}={first!r}, the way {who} read it; "
            + "; ".join(f"{w} read it as {name}={v!r}" for v, w in others)
            + f". Pass {name}=... to from_pretrained (eagle3-hf train: the matching flag) to choose one and silence "
            "this warning."
        )
    return values[0]
