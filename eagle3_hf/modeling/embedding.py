"""The draft's token embedding is the target's: how it is held, compared and written so that nothing rounds it.

The embedding is frozen and belongs to the target, so the draft keeps its values exactly. A draft whose own weights
are in a narrower dtype than the embedding's source (a bfloat16 draft of a float32 target) holds it in the wider
dtype (`set_embedding`), and every export writes it back in its source's dtype (`stored_embedding`). The forward casts
the rows it looks up to the draft's dtype, which gives the same bits as a rounded copy would: holding the embedding
wider changes no output of a narrower draft, it only keeps the values that a float32 reload needs.

Two copies are the same embedding when they agree bit for bit at the precision of the less precise of the two
(`embedding_mismatch`): a copy stored in a narrower dtype (a cast export) must be the target's rounded to it, and a
target loaded in a narrower dtype must be the copy rounded to it. A copy held in the target's own dtype that matches
only after rounding (a float32 tensor of bfloat16 values) is not the target's embedding: the draft's outputs differ.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

__all__ = [
    "embedding_mismatch",
    "embeddings_match",
    "finer",
    "resolve_include_embedding",
    "set_embedding",
    "stored_embedding",
    "target_embedding",
    "whole_tensor",
]

_ROWS = 8192  # rows compared at a time: a 128k x 4k embedding in float32 is 2 GB
# The dtypes a copy of the target's embedding is commonly rounded to (half-precision training or exports).
_ROUNDINGS = (torch.bfloat16, torch.float16)


def whole_tensor(weight: torch.Tensor) -> torch.Tensor:
    """A weight of the target, whole: one of a target sharded with FSDP2 is a slice per process (a DTensor),
    gathered here (a collective: every process of the group must call this). Other tensors are returned as they are."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def target_embedding(target: PreTrainedModel) -> torch.Tensor:
    """The target's input embedding weight ``[V, H]``, whole (gathered from an FSDP2-sharded target)."""
    return whole_tensor(target.get_input_embeddings().weight)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _step(dtype: torch.dtype) -> float:
    """The spacing of `dtype` near 1: the larger, the less precise."""
    return float(torch.finfo(dtype).eps)


def set_embedding(draft: Any, weight: torch.Tensor) -> None:
    """Make `weight` (the target's embedding, or a checkpoint's copy of it) the draft's frozen token embedding.

    It is held in the draft's own dtype when that holds every value exactly, else in the type both promote to (a
    bfloat16 draft holds a float32 embedding in float32), on the device of the draft's embedding; its dtype is recorded
    as `draft.embedding_dtype` so that exports write it as it came. Raises `ValueError` for a weight of another shape.
    """
    param = draft.embed_tokens.weight
    if tuple(weight.shape) != tuple(param.shape):
        raise ValueError(
            f"The token embedding given has shape {tuple(weight.shape)}, the draft expects {tuple(param.shape)} "
            "(vocab_size, hidden_size)."
        )
    held = torch.promote_types(draft.fc.weight.dtype, weight.dtype)
    with torch.no_grad():
        param.data = weight.detach().to(device=param.device, dtype=held, copy=True)
    param.requires_grad_(False)
    draft.embedding_dtype = weight.dtype
    draft.embedding_loaded = True


def stored_embedding(draft: Any) -> torch.Tensor:
    """The draft's token embedding as exports write it: in the dtype it came in (`draft.embedding_dtype`) when the
    draft holds it at least as precisely, which gives back its source's exact values; else as held (a draft cast to a
    narrower dtype by its user writes a cast export, which loaders take for the target's rounded to that dtype)."""
    weight = draft.embed_tokens.weight.detach()
    source = getattr(draft, "embedding_dtype", None)
    if source is None or source == weight.dtype or torch.promote_types(source, weight.dtype) != weight.dtype:
        return weight
    return weight.to(source)


def resolve_include_embedding(draft: Any, include_embedding: bool | None) -> bool:
    """Whether to write the embedding: `None` means "if the draft has one"; True without one raises ValueError."""
    if include_embedding is None:
        return bool(draft.embedding_loaded)
    if include_embedding and not draft.embedding_loaded:
        raise ValueError(
            "include_embedding=True, but this draft has no token embedding (its checkpoint had none); load it with "
            "target=... or call draft.load_target_embedding(target) first."
        )
    return bool(include_embedding)


def _equal_at(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype, via: torch.dtype | None = None) -> bool:
    """Whether both are bit for bit equal once cast to `dtype` (`theirs` rounded to `via` first, if given)."""
    for start in range(0, ours.shape[0], _ROWS):
        a = ours[start : start + _ROWS].detach().to(dtype)
        b = theirs[start : start + _ROWS].detach().to(a.device)
        b = (b.to(via) if via is not None else b).to(dtype)
        if not torch.equal(a, b):
            return False
    return True


def embedding_mismatch(ours: torch.Tensor, theirs: torch.Tensor) -> str | None:
    """None when `ours` is the target's embedding `theirs` (see the module docstring), else how it differs, as a
    phrase that follows "the token embedding"."""
    if tuple(ours.shape) != tuple(theirs.shape):
        return f"has shape {tuple(ours.shape)}, the target's {tuple(theirs.shape)}"
    coarse = ours.dtype if _step(ours.dtype) >= _step(theirs.dtype) else theirs.dtype
    if _equal_at(ours, theirs, coarse):
        return None
    for rounding in _ROUNDINGS:
        if _step(rounding) > _step(coarse) and _equal_at(ours, theirs, coarse, via=rounding):
            return (
                f"holds the target's values rounded to {_name(rounding)} (in {_name(ours.dtype)}), not the target's "
                f"own {_name(theirs.dtype)} values, so the draft's outputs would differ (a draft trained beside a "
                f"{_name(rounding)} copy of the target keeps such a copy: load the target in {_name(rounding)} to use "
                "it as trained)"
            )
    return "differs from the target's"


def embeddings_match(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether `ours` is the target's embedding `theirs` (`embedding_mismatch` finds nothing)."""
    return embedding_mismatch(ours, theirs) is None


def finer(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether `a` is strictly more precise than `b`."""
    return _step(a) < _step(b)
