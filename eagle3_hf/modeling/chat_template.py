"""Rendering with a tokenizer's chat template, the one way every command does it (regenerate, training data, bench).

Templates with a thinking mode (Qwen3-style) read a variable ``enable_thinking``: left undefined, the template's
own default applies (Qwen3: think); ``False`` usually closes an empty think block in the generation prompt. The data
the target answered, the data a draft trains on and the prompts it is benchmarked on must agree on it, so every
caller passes one setting through `apply_chat_template` here:

- ``None``: the template's default; the variable is not passed at all.
- ``True``/``False``: passed as ``enable_thinking=``. A template that never reads the variable renders the same text
  either way; that is a warning (once per template), not an error, so that one configuration can serve targets with
  and without a thinking mode, but the user learns that the flag did nothing.

`thinking_mismatch` words the warning for a run whose setting differs from the one its data was made with.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

THINKING_VARIABLE = "enable_thinking"

__all__ = [
    "THINKING_VARIABLE",
    "apply_chat_template",
    "describe_thinking",
    "has_thinking_switch",
    "thinking_kwargs",
    "thinking_mismatch",
]

_warned: set[str] = set()  # templates already warned about (name and digest), so that the warning comes once


def _template_sources(tokenizer: Any) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates (tool use, ...): any of them may be rendered
        return [t for t in template.values() if isinstance(t, str)]
    return [template] if isinstance(template, str) else []


def has_thinking_switch(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads ``enable_thinking`` (a text search of the Jinja source)."""
    return any(THINKING_VARIABLE in source for source in _template_sources(tokenizer))


def thinking_kwargs(tokenizer: Any, enable_thinking: bool | None) -> dict[str, bool]:
    """The keyword arguments that carry `enable_thinking` to ``tokenizer.apply_chat_template``: none for None (the
    template's default), and none, with a warning once per template, when the template has no thinking switch."""
    if enable_thinking is None:
        return {}
    if not has_thinking_switch(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        digest = hashlib.sha256("\0".join(_template_sources(tokenizer)).encode("utf-8")).hexdigest()[:12]
        if f"{name}:{digest}" not in _warned:
            _warned.add(f"{name}:{digest}")
            logger.warning(
                "%s has no effect: the chat template of %r never reads %s, so it renders the same text either way.",
                describe_thinking(enable_thinking),
                name,
                THINKING_VARIABLE,
            )
        return {}
    return {THINKING_VARIABLE: enable_thinking}


def apply_chat_template(
    tokenizer: Any, messages: list[dict], *, enable_thinking: bool | None = None, **kwargs: Any
) -> Any:
    """``tokenizer.apply_chat_template(messages, **kwargs)`` with the thinking setting passed as `thinking_kwargs`
    says; returns what transformers returns (text, ids or a dict, by `kwargs`)."""
    return tokenizer.apply_chat_template(messages, **kwargs, **thinking_kwargs(tokenizer, enable_thinking))


def describe_thinking(enable_thinking: bool | None) -> str:
    """A setting as the user gives it on the command line."""
    if enable_thinking is None:
        return "the template's default thinking mode (neither --enable-thinking nor --no-enable-thinking)"
    return "--enable-thinking" if enable_thinking else "--no-enable-thinking"


def thinking_mismatch(recorded: bool | None, requested: bool | None, recorded_by: str, requested_by: str) -> str | None:
    """None when the settings agree, else a warning naming both: `recorded_by` made the data ("The answers in
    regen/ were regenerated"), `requested_by` is this run ("this run renders them")."""
    if recorded == requested:
        return None
    return (
        f"{recorded_by} with {describe_thinking(recorded)}, but {requested_by} with {describe_thinking(requested)}: "
        "the chat template renders them differently, so the draft learns or is measured on prompts the target "
        "will not see that way. Give the same thinking flag to both."
    )
