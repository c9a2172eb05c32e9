"""The draft vocabulary: the target tokens a draft can propose, chosen by frequency in the supervised training tokens.

A draft predicts over ``Vd`` ids; ``d2t`` holds offsets (``target_id = draft_id + d2t[draft_id]``, the layout the
official checkpoints, SpecForge, speculators and vLLM use), and ``t2d`` is a bool mask over the ``V`` target ids that
is True exactly at the ids the draft can propose.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from datasets import Dataset
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_hf.modeling.vocab_mapping import draft_to_target_ids, validate_vocab_mapping

__all__ = [
    "DraftVocab",
    "build_draft_vocab",
    "count_supervised_tokens",
    "draft_to_target_ids",
    "load_draft_vocab",
    "save_draft_vocab",
    "validate_vocab_mapping",
]


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary and how well it covers the training data.

    Attributes:
        d2t: int64 ``[Vd]`` offsets, ``target_id = draft_id + d2t[draft_id]``.
        t2d: bool ``[V]``, True at the target ids in the draft vocabulary.
        counts: int64 ``[V]`` supervised-token counts it was built from.
        coverage: share of supervised tokens whose id is in the draft vocabulary (1.0 when it holds every seen id).
        num_seen: distinct ids with a non-zero count.
        num_padded: ids added without being seen, because fewer than ``Vd`` distinct ids were seen.
    """

    d2t: torch.Tensor
    t2d: torch.Tensor
    counts: torch.Tensor
    coverage: float
    num_seen: int
    num_padded: int

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        """The target ids of draft ids ``0..Vd-1``, ascending."""
        return draft_to_target_ids(torch.arange(self.draft_vocab_size), self.d2t)


def count_supervised_tokens(
    dataset: Dataset | Iterable[Mapping], vocab_size: int, batch_size: int = 1024
) -> torch.Tensor:
    """Count how often each target id occurs where ``loss_mask == 1``; returns int64 ``[vocab_size]``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
    if isinstance(dataset, Dataset):
        missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"The dataset lacks the column(s) {sorted(missing)}; it has {dataset.column_names}.")
        batches: Iterable = dataset.select_columns(["input_ids", "loss_mask"]).iter(batch_size=batch_size)
    else:
        # Group plain rows into batches so that bincount runs once per batch, not once per row.
        rows = iter(dataset)
        batches = (
            {"input_ids": [r["input_ids"] for r in chunk], "loss_mask": [r["loss_mask"] for r in chunk]}
            for chunk in iter(lambda: list(itertools.islice(rows, batch_size)), [])
        )
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            if len(ids) != len(mask):
                raise ValueError(f"A row has {len(ids)} input_ids but {len(mask)} loss_mask values.")
        ids = torch.tensor(list(itertools.chain.from_iterable(batch["input_ids"])), dtype=torch.int64)
        mask = torch.tensor(list(itertools.chain.from_iterable(batch["loss_mask"])), dtype=torch.int64)
        supervised = ids[mask == 1]
        if supervised.numel() and (supervised.min() < 0 or supervised.max() >= vocab_size):
            bad = supervised[(supervised < 0) | (supervised >= vocab_size)][0].item()
            raise ValueError(f"Token id {bad} is outside the target vocabulary [0, {vocab_size}).")
        counts += torch.bincount(supervised, minlength=vocab_size)
    return counts


def _as_int(value: object, name: str) -> int:
    try:
        return operator.index(value)  # ints and numpy integers, not floats
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}.") from None


def build_draft_vocab(
    token_counts: torch.Tensor | Dataset | Iterable[Mapping], target_vocab_size: int, draft_vocab_size: int
) -> DraftVocab:
    """Choose the `draft_vocab_size` most frequent supervised target ids.

    `token_counts` is an int ``[target_vocab_size]`` count vector or a tokenised dataset (rows with ``input_ids`` and
    ``loss_mask``). Ties go to the smaller id. When fewer distinct ids were seen than asked, the vocabulary is padded
    with the smallest unseen ids (reported as ``num_padded``). The chosen ids are sorted ascending and stored as
    offsets. ``draft_vocab_size == target_vocab_size`` gives the identity mapping.
    """
    target_vocab_size = _as_int(target_vocab_size, "target_vocab_size")
    draft_vocab_size = _as_int(draft_vocab_size, "draft_vocab_size")
    if target_vocab_size < 1:
        raise ValueError(f"target_vocab_size must be >= 1, got {target_vocab_size}.")
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(
            f"draft_vocab_size must be between 1 and target_vocab_size={target_vocab_size}, got {draft_vocab_size!r}."
        )
    if isinstance(token_counts, torch.Tensor):
        counts = token_counts
        if counts.shape != (target_vocab_size,):
            raise ValueError(
                f"token_counts must have shape ({target_vocab_size},) to match target_vocab_size, "
                f"got {tuple(counts.shape)}."
            )
        if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise ValueError(f"token_counts must hold integer counts, got dtype {counts.dtype}.")
        counts = counts.to(device="cpu", dtype=torch.int64)
        if (counts < 0).any():
            raise ValueError(f"token_counts must be >= 0; id {int((counts < 0).nonzero()[0])} has a negative count.")
    else:
        counts = count_supervised_tokens(token_counts, target_vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("There are no supervised tokens (loss_mask == 1) to choose a draft vocabulary from.")

    # A stable descending sort keeps equal counts in id order, so ties go to the smaller id and the zero-count tail
    # (used for padding) is the smallest unseen ids.
    order = torch.sort(counts, descending=True, stable=True).indices
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    num_seen = int((counts > 0).sum())
    return DraftVocab(
        d2t=d2t,
        t2d=t2d,
        counts=counts,
        coverage=int(counts[used].sum()) / total,
        num_seen=num_seen,
        num_padded=max(0, draft_vocab_size - num_seen),
    )


def save_draft_vocab(path: str | os.PathLike, vocab: DraftVocab) -> None:
    """Write `vocab` to a safetensors file (tensors ``d2t``, ``t2d``, ``counts``; the rest as metadata)."""
    validate_vocab_mapping(vocab.d2t, vocab.t2d, vocab.target_vocab_size)
    tensors = {"d2t": vocab.d2t.contiguous().cpu(), "t2d": vocab.t2d.contiguous().cpu(), "counts": vocab.counts.cpu()}
    metadata = {"coverage": repr(vocab.coverage), "num_seen": str(vocab.num_seen), "num_padded": str(vocab.num_padded)}
    save_file(tensors, os.fspath(path), metadata=metadata)


def load_draft_vocab(path: str | os.PathLike) -> DraftVocab:
    """Read a file written by `save_draft_vocab`, or the vocabulary of a saved draft folder, checking its mapping.

    A draft folder (``model.safetensors`` holding ``d2t`` and ``t2d``) carries no token counts: ``counts`` is then
    all zeros and ``coverage`` is NaN. Reading the vocabulary of a draft is what continuing to train it on offline
    features needs (`eagle3-hf features --vocab DRAFT_FOLDER`).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(
            f"No draft vocabulary at {path!r}: expected a file written by `eagle3-hf vocab` or a draft folder."
        )
    if os.path.isdir(path):
        return _vocab_of_draft_folder(path)
    with safe_open(path, framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata() or {}
        missing = {"d2t", "t2d", "counts"} - keys
        if missing:
            raise ValueError(f"{path!r} is not a draft vocabulary file: it lacks {sorted(missing)}.")
        d2t, t2d, counts = (f.get_tensor(k) for k in ("d2t", "t2d", "counts"))
    validate_vocab_mapping(d2t, t2d, t2d.numel())
    return DraftVocab(
        d2t=d2t,
        t2d=t2d,
        counts=counts,
        coverage=float(metadata.get("coverage", "nan")),
        num_seen=int(metadata.get("num_seen", int((counts > 0).sum()))),
        num_padded=int(metadata.get("num_padded", 0)),
    )


def _vocab_of_draft_folder(folder: str) -> DraftVocab:
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        raise ValueError(
            f"{folder!r} is a folder without model.safetensors: expected a draft vocabulary file or a saved draft."
        )
    with safe_open(weights, framework="pt") as f:
        missing = {"d2t", "t2d"} - set(f.keys())
        if missing:
            raise ValueError(f"{weights!r} holds no draft vocabulary: it lacks {sorted(missing)}.")
        d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
    validate_vocab_mapping(d2t, t2d, t2d.numel())
    return DraftVocab(
        d2t=d2t, t2d=t2d, counts=torch.zeros(t2d.numel(), dtype=torch.long), coverage=float("nan"),
        num_seen=0, num_padded=0,
    )  # fmt: skip
