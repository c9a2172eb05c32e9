"""A conversation rendered with the target's chat template, as rows of tokens with a loss mask on the assistant answers.

Policy: each assistant answer is supervised exactly as the target generates it after that turn's prompt (the
conversation so far, rendered with the generation prompt), from the first token it writes through the end-of-turn
token that closes the answer (the tokenizer's eos token), because the draft must learn where the target stops. The
role header and what the generation prompt already holds are context, never supervised; so is the template's
whitespace after the end-of-turn token.

How the answers are found, by testing what the template does rather than by its name:

- Templates with ``{% generation %}`` markers define the assistant text themselves; their markers are used as is.
- Otherwise turn ``i`` is rendered twice: its prompt (``messages[:i]`` with the generation prompt) and the prompt
  followed by its answer (``messages[:i+1]``); the answer is what the second adds to the first, cut after the last
  eos token in it. The whole conversation is one row when its rendering holds every answer as its own turn rendered
  it (a prefix-stable template). Where the template rewrites earlier turns once a later one exists (Qwen3 drops the
  reasoning of every answer before the last user message), an answer rendered otherwise in a later turn's prompt is
  supervised in a row of its own that ends with it, the conversation as the target saw it at that turn; a later row
  holds it as context only.
- Reasoning: where the template writes an empty reasoning block before an answer that has none (Qwen3 in thinking
  mode writes ``<think>\\n\\n</think>\\n\\n``), that block is context, not supervised: a thinking target never writes
  it. A template is taken to do this when an answer given ``reasoning_content`` renders it where the empty block
  stood. An answer that holds its reasoning (``<think>...</think>`` as `regenerate` writes it) is supervised as
  written. With ``enable_thinking=False`` the generation prompt holds the empty block and the answer follows it; an
  answer holding reasoning then renders no longer after that prompt, so its reasoning is dropped (the target
  writes none there) and counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from eagle3_hf.modeling.chat_template import apply_chat_template

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PLACEHOLDER = "EAGLE3HFPLACEHOLDER"
_REASONING_PLACEHOLDER = "EAGLE3HFREASONING"
# Where an answer's reasoning ends, in the answers `regenerate` writes (the Qwen3, QwQ and DeepSeek-R1 convention).
REASONING_END = "</think>"

__all__ = [
    "REASONING_END",
    "Rendering",
    "chat_template_source",
    "has_generation_markers",
    "render_rows",
    "tokenize_conversation",
    "tokenize_conversation_rows",
]


def has_generation_markers(chat_template: str | None) -> bool:
    """Whether a chat template marks assistant text with ``{% generation %}`` blocks."""
    return bool(chat_template) and _GENERATION_MARKER.search(chat_template) is not None


def chat_template_source(tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja source `apply_chat_template` renders with; `ValueError` when the tokenizer has none."""
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
    text = _render(tokenizer, [{**message, "content": _PLACEHOLDER}], enable_thinking=enable_thinking)
    if _PLACEHOLDER not in text:
        raise ValueError(
            f"The chat template of {tokenizer.name_or_path!r} does not render a message's content verbatim, so "
            "assistant turns cannot be located. Add {% generation %} ... {% endgeneration %} markers around "
            "assistant text to the template."
        )
    return text[: text.index(_PLACEHOLDER)]


def _empty_reasoning(
    tokenizer: PreTrainedTokenizerBase, history: list[dict], prompt: str, enable_thinking: bool | None
) -> str:
    """The empty reasoning block the template writes after `prompt` before an answer without reasoning ("" when it
    writes none): the text before a placeholder answer, where an answer given ``reasoning_content`` shows it."""
    plain = _render(
        tokenizer, [*history, {"role": "assistant", "content": _PLACEHOLDER}], enable_thinking=enable_thinking
    )
    reasoned = _render(
        tokenizer,
        [*history, {"role": "assistant", "content": _PLACEHOLDER, "reasoning_content": _REASONING_PLACEHOLDER}],
        enable_thinking=enable_thinking,
    )
    if not (plain.startswith(prompt) and _PLACEHOLDER in plain[len(prompt) :]):
        return ""
    block = plain[len(prompt) : plain.index(_PLACEHOLDER, len(prompt))]
    shown = reasoned[len(prompt) :] if reasoned.startswith(prompt) else ""
    return block if block and _REASONING_PLACEHOLDER in shown.split(_PLACEHOLDER)[0] else ""


def _without_reasoning(message: dict) -> dict | None:
    """`message` with the reasoning it holds (up to `REASONING_END`) dropped; None when it holds none."""
    if REASONING_END not in message["content"]:
        return None
    return {**message, "content": message["content"].rsplit(REASONING_END, 1)[1].lstrip("\n")}


@dataclass
class _Answer:
    """One assistant turn as its own prompt renders it: ``text[start:end]`` is what the target writes."""

    text: str
    start: int
    end: int
    reasoning_dropped: bool = False


def _answer(tokenizer: PreTrainedTokenizerBase, messages: list[dict], i: int, enable_thinking: bool | None) -> _Answer:
    history, message = messages[:i], messages[i]
    if i == 0:
        prompt = _opening_header(tokenizer, message, enable_thinking)
    else:
        prompt = _render(tokenizer, history, add_generation_prompt=True, enable_thinking=enable_thinking)
    text, dropped = _render(tokenizer, [*history, message], enable_thinking=enable_thinking), False
    if not text.startswith(prompt) and (plain := _without_reasoning(message)) is not None:
        # enable_thinking=False: the prompt closes an empty think block, so the target writes no reasoning here.
        text, dropped = _render(tokenizer, [*history, plain], enable_thinking=enable_thinking), True
    if not text.startswith(prompt):
        raise ValueError(
            f"The chat template of {tokenizer.name_or_path!r} renders assistant turn {i} so that it does not extend "
            f"the prompt of that turn (the first {i} messages with the generation prompt), so the answer the target "
            "writes after that prompt cannot be located. Add {% generation %} ... {% endgeneration %} markers around "
            "assistant text to the template."
        )
    start = len(prompt)
    if i and (block := _empty_reasoning(tokenizer, history, prompt, enable_thinking)):
        if text.startswith(block, start):
            start += len(block)  # the template's empty reasoning block: a thinking target never writes it
    end, eos = len(text), tokenizer.eos_token
    if eos and eos in text[start:]:
        end = text.rindex(eos) + len(eos)
    return _Answer(text, start, end, dropped)


@dataclass
class Rendering:
    """One row of a conversation: its text and the character spans of the answers it supervises."""

    text: str
    spans: list[tuple[int, int]]


def render_rows(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], enable_thinking: bool | None = None
) -> tuple[list[Rendering], int]:
    """The rows a conversation trains as (see the module docstring), in turn order, and how many answers had their
    reasoning dropped. One row, the whole conversation, where the template renders every answer there as its own
    turn did; else each row ends with the latest answer not yet supervised and supervises every answer it holds as
    that answer's own prompt led to it, so that each answer is supervised once. `enable_thinking`: see
    `eagle3_hf.modeling.chat_template`."""
    answers = {
        i: _answer(tokenizer, messages, i, enable_thinking)
        for i, message in enumerate(messages)
        if message["role"] == "assistant"
    }
    dropped = sum(a.reasoning_dropped for a in answers.values())
    if not answers:
        return [Rendering(_render(tokenizer, messages, enable_thinking=enable_thinking), [])], 0
    pending, rows = sorted(answers), []
    whole = _render(tokenizer, messages, enable_thinking=enable_thinking)
    while pending:
        last = answers[pending[-1]]
        # The latest answer not yet supervised ends the row; the whole conversation (its trailing question too)
        # where that holds it unchanged.
        text = whole if not rows and whole.startswith(last.text[: last.end]) else last.text
        held = [i for i in pending if text.startswith(answers[i].text[: answers[i].end])]
        rows.append(Rendering(text, [(answers[i].start, answers[i].end) for i in held]))
        pending = [i for i in pending if i not in held]
    return rows[::-1], dropped


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


def _row(input_ids: list[int], loss_mask: list[int], max_length: int, **extra: int) -> dict[str, list[int] | int]:
    cut = max(0, len(input_ids) - max_length)
    return {
        "input_ids": input_ids[:max_length],
        "loss_mask": loss_mask[:max_length],
        "attention_mask": [1] * min(len(input_ids), max_length),
        "num_tokens_cut": cut,
        **extra,
    }


def tokenize_conversation_rows(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int, enable_thinking: bool | None = None
) -> list[dict[str, list[int] | int]]:
    """Tokenise one conversation with the tokenizer's own chat template into its rows (`render_rows`; one for a
    prefix-stable template or one with generation markers). Each row holds ``input_ids``, ``loss_mask`` (1 on the
    supervised answer tokens), ``attention_mask``, ``num_tokens_cut`` (tokens dropped from the end to fit
    `max_length`) and ``reasoning_dropped`` (answers whose reasoning was left out, counted on the first row)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
    if has_generation_markers(chat_template_source(tokenizer)):
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
        return [_row(input_ids, loss_mask, max_length, reasoning_dropped=0)]
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"Locating assistant tokens needs a fast tokenizer (character offsets); {type(tokenizer).__name__} "
            "is not one."
        )
    renderings, dropped = render_rows(tokenizer, messages, enable_thinking)
    rows = []
    for rendering in renderings:
        encoded = tokenizer(rendering.text, add_special_tokens=False, return_offsets_mapping=True)
        mask = _mask_from_spans(encoded["offset_mapping"], rendering.spans)
        rows.append(_row(list(encoded["input_ids"]), mask, max_length, reasoning_dropped=0 if rows else dropped))
    return rows


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int, enable_thinking: bool | None = None
) -> dict[str, list[int] | int]:
    """The one row of a conversation whose template renders it as one (`tokenize_conversation_rows`, without
    ``reasoning_dropped``); `ValueError` where the template makes it several rows (use that function)."""
    rows = tokenize_conversation_rows(tokenizer, messages, max_length, enable_thinking)
    if len(rows) != 1:
        raise ValueError(
            f"The chat template of {tokenizer.name_or_path!r} rewrites earlier turns of this conversation, so it "
            f"trains as {len(rows)} rows, one per answer so rewritten; use tokenize_conversation_rows."
        )
    rows[0].pop("reasoning_dropped")
    return rows[0]
