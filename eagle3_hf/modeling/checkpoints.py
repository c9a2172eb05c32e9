"""Load EAGLE-3 draft checkpoints in any known layout (reading their files is `eagle3_hf.modeling.checkpoint_files`,
writing them `eagle3_hf.modeling.layouts`).

`Eagle3DraftModel.from_pretrained` lands in `load_draft`, which detects the layout (native, official/SpecForge,
speculators), maps keys and config to ours and loads strictly: a missing, unexpected or misshapen weight, an invalid
vocabulary mapping or a truncated file raises `ValueError`. The only weight a checkpoint may lack is the token
embedding, which the official training code never saves; the target supplies it.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from eagle3_hf.modeling.checkpoint_files import (  # noqa: F401  (open_safetensors, read_weights: re-exported)
    HUB_KWARGS,
    corpus_file,
    open_safetensors,
    read_checkpoint,
    read_weights,
)
from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.embedding import (  # noqa: F401  (embeddings_match, whole_tensor: re-exported)
    embeddings_match,
    set_embedding,
    whole_tensor,
)
from eagle3_hf.modeling.layer_keys import check_layers_present
from eagle3_hf.modeling.layout_fields import choose_reading, three_taps
from eagle3_hf.modeling.layouts import (
    EAGLE,
    EMBED_KEY,
    LAYOUTS,
    NATIVE,
    SPECULATORS,
    detect_layout,
    eagle_config_kwargs,
    speculators_config_kwargs,
)
from eagle3_hf.modeling.target_fit import check_target, take_target_embedding

__all__ = [
    "LAYOUTS",
    "detect_layout",
    "embeddings_match",
    "load_draft",
    "open_safetensors",
    "read_checkpoint",
    "read_training_info",
]

logger = hf_logging.get_logger(__name__)


# ------------------------------------------------------------------------------------------------
# config


# What a caller may choose the reading of (`load_draft`): fields that the official/SpecForge layout states in ways its
# readers took differently. A checkpoint that states one unambiguously must agree with the choice.
READING_OPTIONS = ("norm_output", "target_layer_ids")


def draft_config_from(
    layout: str, config: dict[str, Any], keys: Any, source: str, reading: dict[str, Any] | None = None
) -> Eagle3DraftConfig:
    """Our config for a checkpoint of `layout` (RoPE always from the checkpoint itself, never from a target);
    `reading`: the caller's choice among the readings of an ambiguous field (see `READING_OPTIONS`)."""
    try:
        if layout == NATIVE:
            _check_native_keys(config, source)
            draft_config = Eagle3DraftConfig.from_dict(config)
            draft_config.layer_config()  # the layers' own checks (head sizes), while the file can still be named
            return draft_config
        if layout == SPECULATORS:
            fields = speculators_config_kwargs(config)
        else:
            fields = eagle_config_kwargs(config, keys, reading)
        draft_config = Eagle3DraftConfig(**{k: v for k, v in fields.items() if v is not None})
        # Name a depth the weights do not hold in layers (not as a list of missing or unexpected weights).
        check_layers_present(draft_config.num_hidden_layers, keys, f"{layout} layout")
        return draft_config
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: invalid draft config: {err}") from err


# Keys transformers itself writes into a model's config.json at run time: the Trainer's checkpoints carry
# `use_cache` (it turns the cache off while training). They are ours, so loading them says nothing.
RUNTIME_KEYS = frozenset({"use_cache"})


def _check_native_keys(config: dict[str, Any], source: str) -> None:
    """Refuse a key that looks like a misspelt config field (`hiden_size`): from_dict would keep it and silently
    use the default for the real one. Other unknown keys (another version's fields) are only logged."""
    known = set(Eagle3DraftConfig().to_dict()) | set(inspect.signature(Eagle3DraftConfig.__init__).parameters)
    known |= RUNTIME_KEYS
    for key in sorted(set(config) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
        if close:
            raise ValueError(f"{source}: config.json has the unknown key {key!r}; did you mean {close[0]!r}?")
        logger.warning("%s: config.json has the unknown key %r (kept as an attribute).", source, key)


# ------------------------------------------------------------------------------------------------
# checks


def _prepare_vocab(state_dict: dict[str, torch.Tensor], config: Eagle3DraftConfig, source: str) -> None:
    """Fill in an absent vocabulary mapping (identity, or derived from its other half) and fix its dtypes."""
    vocab, draft_vocab = config.vocab_size, config.draft_vocab_size
    d2t, t2d = state_dict.get("d2t"), state_dict.get("t2d")
    if d2t is not None and (d2t.is_floating_point() or d2t.dtype == torch.bool):
        raise ValueError(f"{source}: d2t must hold integer offsets, got dtype {d2t.dtype}.")
    if t2d is not None and t2d.dtype != torch.bool:
        if t2d.is_floating_point() or not bool(((t2d == 0) | (t2d == 1)).all()):
            raise ValueError(f"{source}: t2d must be a 0/1 membership mask, got dtype {t2d.dtype}.")
        t2d = t2d.bool()
    if d2t is None and t2d is None:
        if draft_vocab != vocab:
            raise ValueError(
                f"{source}: the checkpoint has no d2t/t2d vocabulary mapping, but its draft vocabulary "
                f"(draft_vocab_size={draft_vocab}) is smaller than the target's (vocab_size={vocab})."
            )
        d2t, t2d = torch.zeros(draft_vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    elif t2d is None and d2t.ndim == 1:
        mapped = torch.arange(d2t.numel()) + d2t.long()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[mapped[(mapped >= 0) & (mapped < vocab)]] = True  # out-of-range ids are reported by the check
    elif d2t is None and t2d.ndim == 1:
        ids = t2d.nonzero()[:, 0]
        d2t = ids - torch.arange(ids.numel())
    state_dict["d2t"], state_dict["t2d"] = d2t.long(), t2d


def _check_state_dict(cls: type, config: Eagle3DraftConfig, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise `ValueError` listing every missing, unexpected and misshapen weight (the embedding may be absent)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    missing = sorted(set(expected) - set(state_dict) - {EMBED_KEY})
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [
        f"{k} expected {expected[k]}, got {tuple(v.shape)}"
        for k, v in sorted(state_dict.items())
        if k in expected and tuple(v.shape) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing weight(s) {missing}")
    if unexpected:
        problems.append(f"unexpected weight(s) {unexpected}")
    if wrong:
        problems.append("wrong shape(s): " + "; ".join(wrong))
    if problems:
        flags = {
            k: getattr(config, k)
            for k in ("layer_type", "num_hidden_layers", "norm_before_fc", "fc_norm", "attention_bias")
        }
        raise ValueError(f"{source} does not match its config {flags}: " + " | ".join(problems) + ".")
    from eagle3_hf.modeling.vocab_mapping import validate_vocab_mapping

    try:
        validate_vocab_mapping(state_dict["d2t"], state_dict["t2d"], config.vocab_size)
    except ValueError as err:
        raise ValueError(f"{source}: invalid vocabulary mapping: {err}") from err


# ------------------------------------------------------------------------------------------------
# loading


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report: we check keys ourselves, and an absent embedding is expected."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_draft(
    cls: type, path_or_id: str | os.PathLike, *model_args: Any, target: PreTrainedModel | None = None, **kwargs: Any
) -> Any:
    """Load an EAGLE-3 draft of class `cls` from a local folder or Hub id in any supported layout.

    Args:
        cls: the draft class (`Eagle3DraftModel` or a subclass).
        path_or_id: checkpoint folder or Hub repo id (`revision`, `cache_dir`, `token`, `subfolder`, ... apply).
        target: the target model. The draft is checked against it, takes its embedding when the checkpoint has
            none, and defaults to its dtype and device (`eagle3_hf.bind_target(draft, target)` then routes
            `target.generate(..., assistant_model=draft)` to EAGLE-3).
        use_target_embedding (`bool`): replace an embedding stored in the checkpoint by the target's; without it, a
            stored embedding that is not bit for bit the target's raises `ValueError` (one stored in a narrower dtype
            must be the target's rounded to it, and is then replaced by the target's own; see `embedding_mismatch`).
        norm_output (`bool`), target_layer_ids (`list[int]`): the reading of a field that an official/SpecForge
            checkpoint states in a way its readers took differently (``norm_output: true`` was EAGLE-3 to SpecForge
            before its PR #879; tap ids whose first is not 1), which otherwise loads as today's vLLM and SGLang read
            it, with a warning; in any layout, a value the checkpoint does not state raises `ValueError`.
        dtype / torch_dtype, device, device_map, attn_implementation, ...: as for `PreTrainedModel.from_pretrained`;
            `dtype` defaults to the target's, else to the checkpoint's ("auto": its own weights' dtype). The embedding
            is never rounded: a narrower `dtype` keeps it in its source's precision (`set_embedding`).
    """
    use_target_embedding = bool(kwargs.pop("use_target_embedding", False))
    hub_kwargs = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    device = kwargs.pop("device", None)
    config_override = kwargs.pop("config", None)
    reading = _reading_options(kwargs)
    source = repr(os.fspath(path_or_id))
    if use_target_embedding and target is None:
        raise ValueError("use_target_embedding=True needs the target: pass target=... as well.")

    layout, raw_config, state_dict = read_checkpoint(path_or_id, **hub_kwargs)
    if isinstance(config_override, Eagle3DraftConfig):
        config = config_override
    elif config_override is not None:
        raise ValueError(f"config must be an Eagle3DraftConfig, got {type(config_override).__name__}.")
    else:
        config = draft_config_from(layout, raw_config, state_dict.keys(), f"{source} ({layout} layout)", reading)
    if target is not None:
        check_target(config, target)
        reference = target.get_input_embeddings().weight
        dtype = reference.dtype if dtype is None else dtype
        if device is None and kwargs.get("device_map") is None:
            device = reference.device
    if layout != EAGLE or config_override is not None:  # the others state these fields one way only
        for name, given in reading.items():
            choose_reading(name, [(getattr(config, name), "as it states")], given, f"the {layout} checkpoint {source}")
    _prepare_vocab(state_dict, config, source)
    _check_state_dict(cls, config, state_dict, f"{source} ({layout} layout)")
    has_embedding = EMBED_KEY in state_dict
    if dtype is None or dtype == "auto":
        # The dtype of the draft's own weights as stored. transformers' "auto" takes the first floating tensor's,
        # which is the embedding's when there is one, and exports keep that in the target's (maybe wider) dtype.
        dtype = state_dict["fc.weight"].dtype

    with _quiet_transformers():
        draft, info = PreTrainedModel.from_pretrained.__func__(
            cls,
            None,
            *model_args,
            config=config,
            state_dict=state_dict,
            dtype=dtype,
            output_loading_info=True,
            **kwargs,
        )
    leftovers = (set(info["missing_keys"]) - {EMBED_KEY}) | set(info["unexpected_keys"]) | set(info["mismatched_keys"])
    if leftovers or info["error_msgs"]:
        problems = sorted(map(str, leftovers)) + list(info["error_msgs"])
        raise ValueError(f"{source}: transformers did not load every weight: {problems}")
    draft.config._name_or_path = os.fspath(path_or_id)
    draft.embedding_loaded = has_embedding
    if has_embedding:  # as stored: transformers cast it to the draft's dtype, which may round it
        set_embedding(draft, state_dict[EMBED_KEY])
    draft.training_info = read_training_info(path_or_id)
    draft.corpus = corpus_file(path_or_id, hub_kwargs)  # its target's earlier answers, read by generate()
    draft.embed_tokens.weight.requires_grad_(False)  # frozen, like the target's; the reload made a fresh Parameter
    if device is not None:
        draft.to(device)
    if target is not None:
        take_target_embedding(draft, target, source, replace=use_target_embedding)
    return draft


def _reading_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the `READING_OPTIONS` given (not None) from `kwargs`, checked."""
    reading = {name: value for name in READING_OPTIONS if (value := kwargs.pop(name, None)) is not None}
    if not isinstance(reading.get("norm_output", False), bool):
        raise ValueError(f"norm_output must be True or False, got {reading['norm_output']!r}.")
    if "target_layer_ids" in reading:
        reading["target_layer_ids"] = three_taps(reading["target_layer_ids"], "target_layer_ids passed")
    return reading


def read_training_info(path_or_id: str | os.PathLike) -> dict[str, Any] | None:
    """`training_info.json` of a local draft folder (what its card shows), if it has one."""
    path = os.path.join(os.fspath(path_or_id), "training_info.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            info = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path!r} is not valid JSON: {err}") from err
    return info if isinstance(info, dict) else None
