"""Training conversations: read them, render them with the target's chat template, mask the assistant tokens.

Every accepted record format is normalised to ``{"id": str, "messages": [{"role", "content"}, ...]}`` with roles
``system``, ``user`` and ``assistant``. `build_dataset` tokenises them into rows (`eagle3_hf.training.loss_mask`
says which tokens are supervised: each assistant answer as the target writes it after that turn's prompt, through its
end-of-turn token; one row per conversation, or one per answer where the template rewrites earlier turns).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from eagle3_hf.modeling.chat_template import describe_thinking
from eagle3_hf.training.data_files import (  # noqa: F401 (DATA_SUFFIXES, is_dataset_id: re-exported)
    DATA_SUFFIXES,
    is_dataset_id,
    not_utf8_error,
    read_records,
)
from eagle3_hf.training.loss_mask import (  # noqa: F401 (tokenize_conversation: re-exported)
    chat_template_source,
    has_generation_markers,
    tokenize_conversation,
    tokenize_conversation_rows,
)

logger = logging.getLogger(__name__)

# Speaker names seen in ShareGPT dumps and chat data sets; "chatgpt", "bing" and "bard" are assistant answers.
_ROLE_ALIASES = MappingProxyType(
    {
        "system": "system",
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "chatgpt": "assistant",
        "bing": "assistant",
        "bard": "assistant",
        "model": "assistant",
    }
)
_FORMATS = (
    "ShareGPT ('conversations' of {'from', 'value'}), messages ('messages' of {'role', 'content'}), "
    "Alpaca ('instruction', 'output')"
)

__all__ = [
    "DATA_SUFFIXES",
    "DataStats",
    "as_conversations",
    "build_dataset",
    "has_generation_markers",
    "is_dataset_id",
    "normalize_conversation",
    "normalize_messages",
    "read_conversations",
    "tokenize_conversation",
    "tokenize_conversation_rows",
]


# ----------------------------------------------------------------------------------------------------------------
# Reading and normalising
# ----------------------------------------------------------------------------------------------------------------


def _normalize_turn(turn: object, where: str) -> dict[str, str]:
    if not isinstance(turn, Mapping):
        raise ValueError(f"{where}: expected a turn as a dict, got {type(turn).__name__}.")
    # Rows read through `datasets` carry every key of the file's schema, None where a record lacks it.
    if turn.get("role") is not None and "content" in turn:
        speaker, text = turn["role"], turn["content"]
    elif turn.get("from") is not None and "value" in turn:
        speaker, text = turn["from"], turn["value"]
    else:
        keys = sorted(k for k, v in turn.items() if v is not None)
        raise ValueError(f"{where}: a turn has keys {keys}; expected 'role'/'content' or 'from'/'value'.")
    role = _ROLE_ALIASES.get(str(speaker).lower())
    if role is None:
        raise ValueError(f"{where}: unknown speaker {speaker!r}; expected one of {sorted(_ROLE_ALIASES)}.")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise ValueError(f"{where}: the text of a {role} turn is a {type(text).__name__}, expected a string.")
    return {"role": role, "content": text}


def normalize_messages(record: Mapping | list, where: str = "record") -> list[dict[str, str]]:
    """Turn one record (ShareGPT, messages, Alpaca, or a bare list of turns) into ``[{"role", "content"}, ...]``."""
    if isinstance(record, list):
        turns = record
    elif not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a dict or a list of turns, got {type(record).__name__}.")
    elif record.get("conversations") is not None:
        turns = record["conversations"]
    elif record.get("messages") is not None:
        turns = record["messages"]
    elif record.get("instruction") is not None and record.get("output") is not None:
        prompt = record["instruction"] or ""
        if record.get("input"):
            prompt = f"{prompt}\n\n{record['input']}" if prompt else record["input"]
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        # LLaMA-Factory's Alpaca files keep earlier turns as [question, answer] pairs under "history".
        for question, answer in record.get("history") or []:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    else:
        keys = sorted(k for k, v in record.items() if v is not None)
        raise ValueError(f"{where} has keys {keys}; accepted formats are {_FORMATS}.")
    if not isinstance(turns, list):
        raise ValueError(f"{where}: expected a list of turns, got {type(turns).__name__}.")
    return [_normalize_turn(turn, where) for turn in turns]


def normalize_conversation(record: Mapping | list, index: int) -> dict:
    """Return ``{"id", "messages"}``; the id is the record's own ``id`` or, failing that, its position."""
    record_id = record.get("id") if isinstance(record, Mapping) else None
    return {
        "id": str(index) if record_id is None else str(record_id),
        "messages": normalize_messages(record, where=f"record {index}"),
    }


def read_conversations(source: str | os.PathLike | Dataset | Iterable, limit: int | None = None) -> list[dict]:
    """Read conversations from a data file, a folder of them, a Hub dataset id, a `datasets.Dataset` or an iterable.

    Files are JSON (a list), JSON Lines, either gzip-compressed (``.json.gz``, ``.jsonl.gz``), or parquet, read with
    `datasets.load_dataset` from the local files only; a folder contributes every such file directly in it, in name
    order. A JSON list that is cut off (the ShareGPT dump) is read up to its last whole record. Returns
    ``[{"id", "messages"}, ...]`` with at most `limit` conversations. Conversations without an assistant turn are
    kept here (they are still prompts for `regenerate_responses`); `build_dataset` skips and counts them.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}.")
    if isinstance(source, (str, os.PathLike)):
        records: Iterable = read_records(os.fspath(source))
        if isinstance(records, Dataset) and limit is not None:
            records = records.select(range(min(limit, len(records))))
    else:
        records = source
    conversations = []
    try:
        for index, record in enumerate(records):
            if limit is not None and index >= limit:
                break
            conversations.append(normalize_conversation(record, index))
    except UnicodeDecodeError as error:
        if not isinstance(source, (str, os.PathLike)):
            raise
        raise not_utf8_error(os.fspath(source), error) from error
    return conversations


@dataclass
class DataStats:
    """What `build_dataset` kept and dropped."""

    conversations_read: int = 0
    skipped_no_assistant: int = 0
    skipped_no_supervised: int = 0  # every assistant token was past max_length
    rows: int = 0  # rows kept: one per conversation, or one per answer where the template rewrites earlier turns
    truncated: int = 0  # rows longer than max_length
    tokens_cut: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    reasoning_dropped: int = 0  # answers whose reasoning the prompt leaves no room for (enable_thinking=False)

    @property
    def conversations_kept(self) -> int:
        return self.conversations_read - self.skipped_no_assistant - self.skipped_no_supervised

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "conversations_kept": self.conversations_kept}


def as_conversations(conversations: Dataset | Iterable) -> list[dict]:
    """Normalise records in any accepted format (or already normalised ones) to ``[{"id", "messages"}, ...]``."""
    return [normalize_conversation(c, i) for i, c in enumerate(conversations)]


def build_dataset(
    conversations: Dataset | Iterable,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    num_proc: int | None = None,
    enable_thinking: bool | None = None,
) -> tuple[Dataset, DataStats]:
    """Tokenise conversations into a `Dataset` with columns ``id``, ``input_ids``, ``loss_mask``, ``attention_mask``.

    `conversations` may be the output of `read_conversations`, raw records in any accepted format, or a `Dataset`
    of either. Each conversation gives one row, or one per answer where the template rewrites earlier turns
    (`eagle3_hf.training.loss_mask`); every row of a conversation carries its id. Conversations without an
    assistant turn are skipped and counted; if none has one, a `ValueError` is raised. Rows longer than
    `max_length` tokens are truncated (the official recipe drops them instead).
    `enable_thinking` is the template's thinking switch (`eagle3_hf.modeling.chat_template`; None: its default).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
    chat_template_source(tokenizer)  # fail before any work when there is no template
    rows = as_conversations(conversations)
    stats = DataStats(conversations_read=len(rows))
    rows = [r for r in rows if any(m["role"] == "assistant" for m in r["messages"])]
    stats.skipped_no_assistant = stats.conversations_read - len(rows)
    if not rows:
        raise ValueError(
            f"None of the {stats.conversations_read} conversations has an assistant turn, so there is nothing to "
            "train on; expected turns with role 'assistant' (or 'gpt' in ShareGPT records)."
        )

    def tokenize(batch: dict) -> dict:
        columns: dict[str, list] = {"id": [], "conversation": []}
        for conversation, (row_id, messages) in enumerate(zip(batch["id"], batch["messages"])):
            for row in tokenize_conversation_rows(tokenizer, messages, max_length, enable_thinking):
                columns["id"].append(row_id)  # every row of a conversation keeps its id: splits go by conversation
                columns["conversation"].append(batch["conversation"][conversation])
                for key, value in row.items():
                    columns.setdefault(key, []).append(value)
        return columns

    rows = [{**row, "conversation": index} for index, row in enumerate(rows)]
    dataset = Dataset.from_list(rows).map(
        tokenize, batched=True, remove_columns=["messages"], num_proc=num_proc, desc="Tokenizing conversations"
    )
    cuts, owners = dataset["num_tokens_cut"], dataset["conversation"]
    supervised = [sum(mask) for mask in dataset["loss_mask"]]
    stats.truncated = sum(1 for c in cuts if c > 0)
    stats.tokens_cut = sum(cuts)
    stats.reasoning_dropped = sum(dataset["reasoning_dropped"])
    keep = [i for i, s in enumerate(supervised) if s > 0]
    stats.skipped_no_supervised = len(rows) - len({owners[i] for i in keep})
    if not keep:
        raise ValueError(
            f"None of the {len(rows)} conversations keeps an assistant token within max_length={max_length} tokens "
            "(the prompt and template come first), so there is nothing to train on; raise max_length."
        )
    dataset = dataset.select(keep).remove_columns(["num_tokens_cut", "conversation", "reasoning_dropped"])
    stats.rows = len(dataset)
    stats.tokens = sum(len(ids) for ids in dataset["input_ids"])
    stats.supervised_tokens = sum(supervised)
    if stats.truncated:
        logger.warning(
            "%d of %d rows were longer than max_length=%d; %d tokens were cut.",
            stats.truncated,
            len(cuts),
            max_length,
            stats.tokens_cut,
        )
    if stats.reasoning_dropped:
        logger.warning(
            "%d answers hold reasoning, but the chat template's generation prompt closes an empty think block (%s), "
            "so the target writes no reasoning there: only their answers are supervised. Give the thinking setting "
            "the answers were written with.",
            stats.reasoning_dropped,
            describe_thinking(enable_thinking),
        )
    return dataset, stats
