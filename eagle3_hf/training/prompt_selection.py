"""Which prompts the target re-answers: repeats and evaluation prompts are dropped before any target time is spent.

A greedy answer to a prompt asked twice is the same answer twice, so a repeated prompt costs target time and adds
nothing to train on: ShareGPT V3 opens 1,809 of its 17,671 conversations with a first turn that an earlier one already
had ("continue" alone 248 times), and Doc2Dial ships every prefix of each dialogue as its own record, whose rounds are
all answered inside the longest one. `dedupe_prompts` keeps one conversation per distinct sequence of prompts,
dropping any whose prompts are the opening rounds of another kept one.

Evaluation prompts must never become training data, or the evaluation measures memory: `exclude_prompts` drops every
conversation that asks one of them (any user turn equal to an evaluation prompt, compared after normalising case and
whitespace), and `read_evaluation_prompts` reads them from MT-bench question files or from any conversation file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

from eagle3_hf.training.data import read_conversations

__all__ = ["dedupe_prompts", "exclude_prompts", "normalize_prompt", "read_evaluation_prompts"]

_SPACE = re.compile(r"\s+")


def normalize_prompt(text: str) -> str:
    """The form prompts are compared in: lower case, runs of whitespace as one space, no surrounding space."""
    return _SPACE.sub(" ", text).strip().lower()


def _prompt_key(messages: list[dict]) -> tuple[tuple[str, str], ...]:
    # Only what the target is asked: the assistant turns are replaced by its own answers anyway.
    return tuple((m["role"], normalize_prompt(m["content"])) for m in messages if m["role"] != "assistant")


def dedupe_prompts(conversations: Iterable[dict]) -> tuple[list[dict], int]:
    """Keep one conversation per distinct sequence of prompts; return the kept ones, in order, and how many went.

    A conversation is dropped when its prompts (system and user turns, normalised) equal those of an earlier one, or
    are the opening prompts of a longer one, which regenerating answers round by round in the same way.
    """
    conversations = list(conversations)
    keys = [_prompt_key(c["messages"]) for c in conversations]
    # Every proper prefix of every conversation, so that a shorter one inside a longer one is found in O(turns).
    inside_longer = {key[:n] for key in keys for n in range(1, len(key))}
    kept, seen = [], set()
    for conversation, key in zip(conversations, keys):
        if key in seen or key in inside_longer:
            continue
        seen.add(key)
        kept.append(conversation)
    return kept, len(conversations) - len(kept)


def _question_file_prompts(path: str) -> list[str] | None:
    """The prompts of a question file as `eagle3-hf bench` reads one (JSON Lines of MT-bench's ``{"turns": [...]}``
    or of ``{"prompt": "..."}``, such as scripts/research/prompts/code_math.jsonl), or None if it is not one."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return None
            if isinstance(record, dict) and isinstance(record.get("turns"), list):
                prompts += [turn for turn in record["turns"] if isinstance(turn, str)]
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            else:
                return None
    return prompts


def read_evaluation_prompts(paths: Iterable[str | os.PathLike]) -> set[str]:
    """The normalised prompts of evaluation sets: MT-bench question files, or the user turns of conversation files.

    Raises `ValueError` naming a path that holds no prompt.
    """
    prompts: set[str] = set()
    for path in map(os.fspath, paths):
        if not os.path.exists(path):
            raise ValueError(f"Evaluation prompts {path!r}: no such file or folder.")
        found = _question_file_prompts(path) if os.path.isfile(path) and path.endswith(".jsonl") else None
        if found is None:
            found = [m["content"] for c in read_conversations(path) for m in c["messages"] if m["role"] == "user"]
        found = [normalize_prompt(p) for p in found if p.strip()]
        if not found:
            raise ValueError(
                f"Evaluation prompts {path!r}: no prompt in it (expected MT-bench questions or conversations)."
            )
        prompts.update(found)
    return prompts


def exclude_prompts(conversations: Iterable[dict], prompts: set[str]) -> tuple[list[dict], int]:
    """Drop every conversation with a user turn among `prompts` (normalised); return the rest and the number dropped."""
    conversations = list(conversations)
    kept = [
        c
        for c in conversations
        if not any(m["role"] == "user" and normalize_prompt(m["content"]) in prompts for m in c["messages"])
    ]
    return kept, len(conversations) - len(kept)
