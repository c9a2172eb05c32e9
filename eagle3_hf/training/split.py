"""The held-out split: a conversation is held out iff a stable hash of its id falls below a fraction.

The hash is sha256 of the id's UTF-8 bytes (not Python's `hash`, which changes between processes), read as a number in
``[0, 1)``. A conversation's side depends on its id alone, so adding, removing or reordering data never moves an
existing conversation between the splits, and every command (`vocab`, `features`, `train`, `evaluate`) draws the same
line without sharing any file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from datasets import Dataset

from eagle3_hf.training.arguments import DEFAULT_HELD_OUT_FRACTION, SPLITS

__all__ = ["DEFAULT_HELD_OUT_FRACTION", "SPLITS", "held_out_score", "is_held_out", "split_filter", "split_held_out"]


def held_out_score(conversation_id: str) -> float:
    """A number in ``[0, 1)`` fixed by the id: the first 8 bytes of its sha256, over 2**64."""
    digest = hashlib.sha256(str(conversation_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"The held-out fraction must be in [0, 1), got {fraction!r}.")


def is_held_out(conversation_id: str, fraction: float = DEFAULT_HELD_OUT_FRACTION) -> bool:
    """True when the conversation `conversation_id` belongs to the held-out split of size `fraction`."""
    _check_fraction(fraction)
    return held_out_score(conversation_id) < fraction


def split_filter(split: str, fraction: float = DEFAULT_HELD_OUT_FRACTION) -> Callable[[Mapping], bool] | None:
    """A ``select(conversation) -> bool`` keeping the ``"train"`` or ``"held-out"`` side; None for ``"all"``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}.")
    _check_fraction(fraction)
    if split == "all":
        return None
    want_held_out = split == "held-out"
    return lambda conversation: (held_out_score(conversation["id"]) < fraction) == want_held_out


def split_held_out(
    rows: Dataset | Iterable[Mapping[str, Any]], fraction: float = DEFAULT_HELD_OUT_FRACTION
) -> tuple[Any, Any]:
    """``(training rows, held-out rows)`` of rows that carry an ``id``: a `Dataset` gives two `Dataset`s (same
    columns), anything else two lists. Order is kept within each side."""
    _check_fraction(fraction)
    if isinstance(rows, Dataset):
        if "id" not in rows.column_names:
            raise ValueError(f"Splitting held-out data needs an 'id' column; the dataset has {rows.column_names}.")
        held = [held_out_score(i) < fraction for i in rows["id"]]
        return rows.select([i for i, h in enumerate(held) if not h]), rows.select([i for i, h in enumerate(held) if h])
    train, held_out = [], []
    for index, row in enumerate(rows):
        if "id" not in row:
            raise ValueError(f"Row {index} has no 'id' (keys {sorted(row)}); the held-out split is chosen by id.")
        (held_out if held_out_score(row["id"]) < fraction else train).append(row)
    return train, held_out
