"""Conversations -> tokenised training rows: the first step every training command shares (vocab, features, train).

Reads one source or several and renders them with the target's chat template (`eagle3_hf.training.data`); the
tokenizer is passed in, so that loading it by target name stays with target loading, on top.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from datasets import Dataset

from eagle3_hf.training.data import DataStats, build_dataset, read_conversations
from eagle3_hf.training.regenerate import regenerated_thinking_mismatch

logger = logging.getLogger(__name__)


def tokenise_data(
    tokenizer: Any,
    data: str | list[str],
    max_length: int,
    max_conversations: int | None = None,
    select: Callable[[dict], bool] | None = None,
    num_proc: int | None = None,
    enable_thinking: bool | None = None,
) -> tuple[Dataset, DataStats]:
    """Read conversations from one source or several (taken in the order given, keeping those `select` accepts,
    then cut to `max_conversations`), render them with `tokenizer`'s chat template in `num_proc` processes (default:
    this one); return (dataset, DataStats). `enable_thinking` is the template's thinking switch (None: its
    default); a source written by `eagle3-hf regenerate` with another setting is warned about."""
    conversations: list[dict] = []
    for source in [data] if isinstance(data, str) else data:
        if warning := regenerated_thinking_mismatch(source, enable_thinking):
            logger.warning(warning)
        left = None if max_conversations is None else max_conversations - len(conversations)
        if select is None:
            conversations += read_conversations(source, limit=left)
        else:
            conversations += [c for c in read_conversations(source) if select(c)][:left]
    if select is not None and not conversations:
        raise ValueError(
            f"No conversation in {data} belongs to the requested split (held-out conversations are chosen by a hash "
            "of their id, about 2% of them): give more data, or another split."
        )
    dataset, stats = build_dataset(
        conversations, tokenizer, max_length, num_proc=num_proc, enable_thinking=enable_thinking
    )
    if os.environ.get("RANK", "0") == "0":  # under torchrun, every process reads the data: one says so
        rows = f" in {stats.rows} rows" if stats.rows != stats.conversations_kept else ""
        print(
            f"Data: {stats.conversations_kept} of {stats.conversations_read} conversations kept{rows}, {stats.tokens} "
            f"tokens, {stats.supervised_tokens} supervised ({stats.skipped_no_assistant} without an assistant turn, "
            f"{stats.truncated} rows truncated to {max_length})."
        )
    return dataset, stats
