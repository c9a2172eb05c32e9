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
from safetensors.torch import save_file

from eagle3_hf.modeling.checkpoints import open_safetensors
from eagle3_hf.modeling.vocab_mapping import draft_to_target_ids, validate_vocab_mapping
from eagle3_hf.training.arguments import DEFAULT_MIN_COVERAGE
from eagle3_hf.training.split import DEFAULT_HELD_OUT_FRACTION, split_held_out

__all__ = [
    "CANDIDATE_VOCAB_SIZES",
    "DraftVocab",
    "VocabChoice",
    "build_draft_vocab",
    "choose_draft_vocab_size",
    "count_supervised_tokens",
    "coverage_by_size",
    "draft_to_target_ids",
    "load_draft_vocab",
    "save_draft_vocab",
    "select_draft_vocab",
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
    with open_safetensors(path) as f:
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
    with open_safetensors(weights) as f:
        missing = {"d2t", "t2d"} - set(f.keys())
        if missing:
            raise ValueError(f"{weights!r} holds no draft vocabulary: it lacks {sorted(missing)}.")
        d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
    validate_vocab_mapping(d2t, t2d, t2d.numel())
    return DraftVocab(
        d2t=d2t,
        t2d=t2d,
        counts=torch.zeros(t2d.numel(), dtype=torch.long),
        coverage=float("nan"),
        num_seen=0,
        num_padded=0,
    )


# ------------------------------------------------------------------------------------------------------------------
# choosing the size by held-out coverage
# ------------------------------------------------------------------------------------------------------------------

CANDIDATE_VOCAB_SIZES = (4096, 8192, 16384, 32768)


def coverage_by_size(
    train_counts: torch.Tensor, held_out_counts: torch.Tensor, sizes: Iterable[int] = CANDIDATE_VOCAB_SIZES
) -> dict[int, float]:
    """Share of `held_out_counts`' tokens that the vocabulary `build_draft_vocab` picks from `train_counts` holds, for
    each size (sizes above the target vocabulary are left out). NaN when there are no held-out tokens."""
    if train_counts.shape != held_out_counts.shape:
        raise ValueError(
            f"train_counts and held_out_counts must cover the same ids, got {tuple(train_counts.shape)} and "
            f"{tuple(held_out_counts.shape)}."
        )
    order = torch.sort(train_counts, descending=True, stable=True).indices  # the order build_draft_vocab picks in
    total = int(held_out_counts.sum())
    return {
        size: (int(held_out_counts[order[:size]].sum()) / total if total else float("nan"))
        for size in sorted(sizes)
        if 1 <= size <= train_counts.numel()
    }


def choose_draft_vocab_size(coverages: Mapping[int, float], min_coverage: float = DEFAULT_MIN_COVERAGE) -> int:
    """The smallest size whose coverage is at least `min_coverage`; the largest size when none reaches it."""
    if not coverages:
        raise ValueError("No candidate draft vocabulary size fits the target vocabulary.")
    if not 0.0 < min_coverage <= 1.0:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage!r}.")
    return next((size for size in sorted(coverages) if coverages[size] >= min_coverage), max(coverages))


@dataclass(frozen=True)
class VocabChoice:
    """What `select_draft_vocab` chose, and the measurements it chose by.

    Attributes:
        vocab: the draft vocabulary, built from the training conversations (held-out ones excluded).
        coverages: candidate size -> share of the held-out supervised tokens that vocabulary of that size holds.
        num_held_out: held-out conversations measured; 0 means there were none and `coverages` were measured on
            the training conversations themselves.
    """

    vocab: DraftVocab
    coverages: dict[int, float]
    num_held_out: int

    def table(self) -> str:
        """The lines `eagle3-hf vocab` and `train --draft-vocab-size auto` print."""
        where = (
            f"{self.num_held_out} held-out conversations"
            if self.num_held_out
            else "no held-out conversations, so measured on the training data"
        )
        lines = [f"Coverage of the target's supervised tokens by draft vocabulary size ({where}):"]
        lines += [
            f"  {size:>6} ids: {100 * c:6.2f}%{'  <- chosen' if size == self.vocab.draft_vocab_size else ''}"
            for size, c in self.coverages.items()
        ]
        return "\n".join(lines)


def select_draft_vocab(
    rows: Dataset | Iterable[Mapping],
    target_vocab_size: int,
    draft_vocab_size: int | str = "auto",
    min_coverage: float = DEFAULT_MIN_COVERAGE,
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION,
    sizes: Iterable[int] = CANDIDATE_VOCAB_SIZES,
) -> VocabChoice:
    """Build the draft vocabulary from all training conversations and measure candidate sizes on held-out ones.

    `rows` are tokenised conversations with ``id``, ``input_ids`` and ``loss_mask``; the held-out ones
    (`eagle3_hf.training.split`) only measure coverage. ``draft_vocab_size="auto"`` picks the smallest of `sizes`
    whose held-out coverage is at least `min_coverage` (the largest when none is); an integer is used as given.
    """
    if draft_vocab_size != "auto" and not isinstance(draft_vocab_size, int):
        raise ValueError(f"draft_vocab_size must be an integer or 'auto', got {draft_vocab_size!r}.")
    train, held_out = split_held_out(rows, held_out_fraction)
    train_counts = count_supervised_tokens(train, target_vocab_size)
    held_counts = count_supervised_tokens(held_out, target_vocab_size) if len(held_out) else None
    if held_counts is None or not held_counts.any():
        held_counts, num_held_out = train_counts, 0
    else:
        num_held_out = len(held_out)
    # A target vocabulary smaller than a candidate caps it (tiny test models): the whole vocabulary is a candidate.
    coverages = coverage_by_size(train_counts, held_counts, {min(size, target_vocab_size) for size in sizes})
    size = choose_draft_vocab_size(coverages, min_coverage) if draft_vocab_size == "auto" else draft_vocab_size
    return VocabChoice(build_draft_vocab(train_counts, target_vocab_size, size), coverages, num_held_out)
