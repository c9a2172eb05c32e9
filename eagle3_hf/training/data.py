"""Training conversations: read them, render them with the target's chat template, mask the assistant tokens.

Every accepted record format is normalised to ``{"id": str, "messages": [{"role", "content"}, ...]}`` with roles
``system``, ``user`` and ``assistant``.

Loss-mask policy: a token is supervised (``loss_mask == 1``) when it overlaps the text of an assistant turn, from the
first character of its content through the end-of-turn token that closes it (the tokenizer's eos token, e.g. the
ChatML end-of-turn token), because the draft must learn to predict where the target stops. The role header before the
content and the template's whitespace after the end-of-turn token are not supervised: the target never generates them.
Templates with ``{% generation %}`` markers define the assistant text themselves, and their markers are used as is.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from eagle3_hf.modeling.chat_template import apply_chat_template
from eagle3_hf.training.data_files import (  # noqa: F401 (DATA_SUFFIXES, is_dataset_id: re-exported)
    DATA_SUFFIXES,
    is_dataset_id,
    not_utf8_error,
    read_records,
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
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

__all__ = [
    "DATA_SUFFIXES",
    "DataStats",
    "as_conversations",
    "assistant_char_spans",
    "build_dataset",
    "has_generation_markers",
    "is_dataset_id",
    "normalize_conversation",
    "normalize_messages",
    "read_conversations",
    "tokenize_conversation",
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


# ----------------------------------------------------------------------------------------------------------------
# Tokenising with an assistant-only loss mask
# ----------------------------------------------------------------------------------------------------------------


def has_generation_markers(chat_template: str | None) -> bool:
    """Whether a chat template marks assistant text with ``{% generation %}`` blocks."""
    return bool(chat_template) and _GENERATION_MARKER.search(chat_template) is not None


def _chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is what apply_chat_template uses
        template = template.get("default")
    if not template:
        raise ValueError(
            f"The tokenizer {tokenizer.name_or_path!r} has no chat template, so conversations cannot be rendered. "
            "Set `tokenizer.chat_template` to the Jinja template the target was trained with."
        )
    return template


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = False,
    enable_thinking: bool | None = None,
) -> str:
    return apply_chat_template(
        tokenizer,
        messages,
        enable_thinking=enable_thinking,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def _opening_header(tokenizer: PreTrainedTokenizerBase, message: dict, enable_thinking: bool | None = None) -> str:
    """The text a template puts before the content of a conversation's first message (system prompt, role header).

    An empty conversation cannot be rendered, so the first message is rendered with a placeholder for its content.
    """
    placeholder = "EAGLE3HFPLACEHOLDER"
    text = _render(tokenizer, [{**message, "content": placeholder}], enable_thinking=enable_thinking)
    if placeholder not in text:
        raise ValueError(
            f"The chat template of {tokenizer.name_or_path!r} does not render a message's content verbatim, so "
            "assistant turns cannot be located. Add {% generation %} ... {% endgeneration %} markers around "
            "assistant text to the template."
        )
    return text[: text.index(placeholder)]


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], enable_thinking: bool | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and locate each assistant turn in the text by rendering progressively.

    The assistant text of turn ``i`` is what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the generation
    prompt, cut after the last eos token in it. This needs the template to be prefix-stable (rendering more messages
    only appends text); a `ValueError` says so when it is not. `enable_thinking`: see
    `eagle3_hf.modeling.chat_template`.
    """
    text = _render(tokenizer, messages, enable_thinking=enable_thinking)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (
            _render(tokenizer, messages[:i], add_generation_prompt=True, enable_thinking=enable_thinking)
            if i
            else _opening_header(tokenizer, message, enable_thinking)
        )
        through = _render(tokenizer, messages[: i + 1], enable_thinking=enable_thinking)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"The chat template of {tokenizer.name_or_path!r} is not prefix-stable: rendering the first {i + 1} "
                f"messages does not extend the rendering of the first {i} (with the generation prompt), so assistant "
                "turns cannot be located. Add {% generation %} ... {% endgeneration %} markers around assistant text "
                "to the template."
            )
        end = len(through)
        if eos and eos in through[len(before) :]:
            end = through.rindex(eos) + len(eos)
        spans.append((len(before), end))
    return text, spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token overlapping a character span (the rule transformers uses for generation markers).

    Tokens and spans are both in text order, so one pass suffices.
    """
    mask = [0] * len(offsets)
    span = 0
    for index, (token_start, token_end) in enumerate(offsets):
        while span < len(spans) and token_start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if token_end > spans[span][0]:
            mask[index] = 1
    return mask


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int, enable_thinking: bool | None = None
) -> dict[str, list[int] | int]:
    """Tokenise one conversation with the tokenizer's own chat template (`enable_thinking`: see
    `eagle3_hf.modeling.chat_template`).

    Returns ``input_ids``, ``loss_mask`` (1 on assistant tokens, see the module docstring), ``attention_mask`` and
    ``num_tokens_cut``, the number of tokens dropped from the end to fit `max_length`.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
    template = _chat_template(tokenizer)
    if has_generation_markers(template):
        encoded = apply_chat_template(
            tokenizer,
            messages,
            enable_thinking=enable_thinking,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        input_ids, loss_mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
        # transformers fills the mask silently (all zeros) when the markers produce no span; catch it here.
        if not any(loss_mask) and any(m["role"] == "assistant" and m["content"] for m in messages):
            raise ValueError(
                f"The chat template of {tokenizer.name_or_path!r} has generation markers, but they marked no token of "
                "this conversation's assistant turns; check that they wrap the assistant content."
            )
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"Locating assistant tokens needs a fast tokenizer (character offsets); {type(tokenizer).__name__} "
                "is not one."
            )
        text, spans = assistant_char_spans(tokenizer, messages, enable_thinking)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids, loss_mask = list(encoded["input_ids"]), _mask_from_spans(encoded["offset_mapping"], spans)
    cut = max(0, len(input_ids) - max_length)
    return {
        "input_ids": input_ids[:max_length],
        "loss_mask": loss_mask[:max_length],
        "attention_mask": [1] * min(len(input_ids), max_length),
        "num_tokens_cut": cut,
    }


@dataclass
class DataStats:
    """What `build_dataset` kept and dropped."""

    conversations_read: int = 0
    skipped_no_assistant: int = 0
    skipped_no_supervised: int = 0  # every assistant token was past max_length
    truncated: int = 0
    tokens_cut: int = 0
    tokens: int = 0
    supervised_tokens: int = 0

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
    of either. Conversations without an assistant turn are skipped and counted; if none has one, a `ValueError` is
    raised. Conversations longer than `max_length` tokens are truncated (the official recipe drops them instead).
    `enable_thinking` is the template's thinking switch (`eagle3_hf.modeling.chat_template`; None: its default).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
    _chat_template(tokenizer)  # fail before any work when there is no template
    rows = as_conversations(conversations)
    stats = DataStats(conversations_read=len(rows))
    rows = [r for r in rows if any(m["role"] == "assistant" for m in r["messages"])]
    stats.skipped_no_assistant = stats.conversations_read - len(rows)
    if not rows:
        raise ValueError(
            f"None of the {stats.conversations_read} conversations has an assistant turn, so there is nothing to "
            "train on; expected turns with role 'assistant' (or 'gpt' in ShareGPT records)."
        )

    def tokenize(row: dict) -> dict:
        return tokenize_conversation(tokenizer, row["messages"], max_length, enable_thinking)

    dataset = Dataset.from_list(rows).map(
        tokenize, remove_columns=["messages"], num_proc=num_proc, desc="Tokenizing conversations"
    )
    cuts = dataset["num_tokens_cut"]
    supervised = [sum(mask) for mask in dataset["loss_mask"]]
    stats.truncated = sum(1 for c in cuts if c > 0)
    stats.tokens_cut = sum(cuts)
    stats.skipped_no_supervised = sum(1 for s in supervised if s == 0)
    keep = [i for i, s in enumerate(supervised) if s > 0]
    if not keep:
        raise ValueError(
            f"None of the {len(rows)} conversations keeps an assistant token within max_length={max_length} tokens "
            "(the prompt and template come first), so there is nothing to train on; raise max_length."
        )
    dataset = dataset.select(keep).remove_columns("num_tokens_cut")
    stats.tokens = sum(len(ids) for ids in dataset["input_ids"])
    stats.supervised_tokens = sum(supervised)
    if stats.truncated:
        logger.warning(
            "%d of %d conversations were longer than max_length=%d; %d tokens were cut.",
            stats.truncated,
            len(rows),
            max_length,
            stats.tokens_cut,
        )
    return dataset, stats
