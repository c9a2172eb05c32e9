"""The target's earlier answers as token sequences: what `eagle3-hf corpus` indexes (generation/corpus_index.py).

The answers are read from `eagle3-hf regenerate` output folders (or any conversation files) and tokenised exactly as
training tokenises them (`data.build_dataset`: the target's chat template, the loss mask on each assistant turn
from its first content token through its end-of-turn token), and only the supervised tokens go in, one document per
assistant turn: the ids the target wrote, in the form decoding sees them. No answer is cut (training cuts at
`max_length`; a corpus has no such limit).

Conversations that ask an evaluation prompt are left out, as `regenerate --exclude-prompts` leaves them out of
training data (`prompt_selection.exclude_prompts`): a corpus holding the evaluation's own answers would make a
benchmark measure recall, not speed-up. The caller names the prompts (`exclude`, normalised as
`read_evaluation_prompts` returns them); `eagle3-hf corpus` leaves out the MT-bench questions by default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from eagle3_hf.training.data import build_dataset, read_conversations
from eagle3_hf.training.prompt_selection import exclude_prompts
from eagle3_hf.training.regenerate import regenerated_thinking_mismatch

logger = logging.getLogger(__name__)

__all__ = ["CorpusStats", "answer_spans", "corpus_documents"]

_WHOLE = 1 << 30  # the max_length that cuts no conversation


@dataclass
class CorpusStats:
    """What `corpus_documents` read, left out and kept."""

    conversations_read: int = 0
    conversations_excluded: int = 0  # they ask an evaluation prompt
    answers: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def answer_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of supervised tokens in a tokenised conversation: one per assistant turn."""
    spans, start = [], None
    for i, supervised in enumerate([*loss_mask, 0]):
        if supervised and start is None:
            start = i
        elif not supervised and start is not None:
            spans.append((start, i))
            start = None
    return spans


def corpus_documents(
    tokenizer: Any,
    data: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    exclude: Collection[str],
    num_proc: int | None = None,
    enable_thinking: bool | None = None,
) -> tuple[list[list[int]], CorpusStats]:
    """The token ids of every assistant answer in `data` (one source or several, as `read_conversations` reads
    them), tokenised with `tokenizer` as training does, leaving out each conversation with a user turn among
    `exclude` (normalised prompts; pass an empty set to keep every one) and rendering with the template's thinking
    switch `enable_thinking` (None: its default). Returns (documents, CorpusStats).

    Raises `ValueError` when no answer is left."""
    sources = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    for source in sources:
        if warning := regenerated_thinking_mismatch(source, enable_thinking):
            logger.warning(warning)
    conversations = [c for source in sources for c in read_conversations(source)]
    stats = CorpusStats(conversations_read=len(conversations))
    conversations, stats.conversations_excluded = exclude_prompts(conversations, set(exclude))
    if not conversations:
        raise ValueError(
            f"No conversation is left of the {stats.conversations_read} read from {sources}: every one "
            "asks an evaluation prompt (or there were none)."
        )
    dataset, _ = build_dataset(
        conversations, tokenizer, max_length=_WHOLE, num_proc=num_proc, enable_thinking=enable_thinking
    )
    documents = [
        ids[start:end]
        for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"])
        for start, end in answer_spans(mask)
    ]
    stats.answers, stats.tokens = len(documents), sum(map(len, documents))
    return documents, stats
