"""The draft-to-target vocabulary mapping the draft model carries: ``d2t`` offsets and the ``t2d`` mask.

A draft predicts over ``Vd`` ids; ``target_id = draft_id + d2t[draft_id]`` (the layout the official checkpoints,
SpecForge, speculators and vLLM use), and ``t2d`` is a bool mask over the ``V`` target ids, True exactly at the ids the
draft can propose. Invariant checked by `validate_vocab_mapping`: both describe the same strictly increasing set of
ids in ``[0, V)``. Choosing the ids (by frequency in training data) is `eagle3_hf.training.vocab`.
"""

from __future__ import annotations

import torch

__all__ = ["draft_to_target_ids", "validate_vocab_mapping"]


def draft_to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Map draft ids (any shape, values in ``[0, Vd)``) to target ids: ``draft_ids + d2t[draft_ids]``.

    No range check, so that it costs no device sync inside decoding loops; `validate_vocab_mapping` checks `d2t`.
    """
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


def validate_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, target_vocab_size: int) -> None:
    """Raise `ValueError` unless `d2t` and `t2d` describe the same strictly increasing set of ids in ``[0, V)``."""
    if d2t.ndim != 1 or d2t.is_floating_point() or d2t.dtype == torch.bool or d2t.numel() == 0:
        raise ValueError(f"d2t must be a non-empty 1-D integer tensor, got shape {tuple(d2t.shape)} dtype {d2t.dtype}.")
    if t2d.shape != (target_vocab_size,) or t2d.dtype != torch.bool:
        raise ValueError(
            f"t2d must be a bool tensor of shape ({target_vocab_size},), "
            f"got shape {tuple(t2d.shape)} dtype {t2d.dtype}."
        )
    d2t, t2d = d2t.cpu().to(torch.int64), t2d.cpu()
    mapped = torch.arange(d2t.numel()) + d2t
    outside = ((mapped < 0) | (mapped >= target_vocab_size)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise ValueError(f"d2t maps draft id {i} to target id {int(mapped[i])}, outside [0, {target_vocab_size}).")
    not_increasing = (mapped[1:] <= mapped[:-1]).nonzero()
    if not_increasing.numel():
        i = int(not_increasing[0]) + 1
        raise ValueError(
            f"d2t must map to strictly increasing target ids, but draft id {i} maps to {int(mapped[i])} after "
            f"{int(mapped[i - 1])}."
        )
    missing = (~t2d[mapped]).nonzero()
    if missing.numel():
        i = int(missing[0])
        raise ValueError(f"d2t maps draft id {i} to target id {int(mapped[i])}, but t2d is False there.")
    if int(t2d.sum()) != d2t.numel():
        extra = int((t2d & ~torch.isin(torch.arange(target_vocab_size), mapped)).nonzero()[0])
        raise ValueError(
            f"t2d marks {int(t2d.sum())} ids but d2t has {d2t.numel()}; target id {extra} is in t2d but no draft "
            "id maps to it."
        )
