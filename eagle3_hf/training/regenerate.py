"""Re-answer training prompts with the target itself.

EAGLE-3 trains the draft to predict the target, so the assistant turns of the training data are best written by the
target. `regenerate_responses` keeps every system and user turn of each conversation and replaces every assistant
turn by the target's own answer, feeding the regenerated earlier answers back as history. A user turn that the data
set left unanswered (a trailing question, or a prompt-only data set) is answered too.

Output: ShareGPT records (``{"id", "conversations": [{"from", "value"}]}``) in ``shard_00000.jsonl``,
``shard_00001.jsonl``, ... Each shard is written to a hidden temporary name and renamed when complete, so a killed
run leaves only whole shards; a new run skips every id found in them. ``.regenerate.json`` records the data (a
fingerprint of its first conversation, so that a run may continue or extend the same data) and the generation
settings: a run with other data or settings into the same folder is refused rather than skipping prompts whose ids
happen to match or mixing two data sets. Read the result back with
`eagle3_hf.training.data.read_conversations(output_dir)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import Counter

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from eagle3_hf.modeling.chat_template import apply_chat_template, thinking_mismatch
from eagle3_hf.training.data import as_conversations, read_conversations
from eagle3_hf.training.manifest import check_manifest, write_manifest
from eagle3_hf.training.regenerate_features import RegeneratedFeatures, SaveFeatures

logger = logging.getLogger(__name__)

_SHARD = re.compile(r"shard_(\d+)\.jsonl")
_SHAREGPT_SPEAKER = {"system": "system", "user": "human", "assistant": "gpt"}

MANIFEST_NAME = ".regenerate.json"  # hidden: reading the folder as data skips it

__all__ = [
    "MANIFEST_NAME",
    "data_fingerprint",
    "list_shards",
    "prompt_rounds",
    "regenerate_manifest",
    "regenerate_responses",
    "regenerated_thinking_mismatch",
]


def prompt_rounds(messages: list[dict]) -> list[list[dict]]:
    """Split a conversation into the non-assistant messages that precede each answer to regenerate.

    Original assistant turns are dropped. A group without a user message (a system prompt, or an assistant greeting
    before the first question) carries over into the next group instead of being answered on its own.
    """
    rounds, group = [], []
    for message in messages:
        if message["role"] != "assistant":
            group.append(message)
        elif any(m["role"] == "user" for m in group):
            rounds.append(group)
            group = []
    if any(m["role"] == "user" for m in group):
        rounds.append(group)
    return rounds


def list_shards(output_dir: str | os.PathLike) -> list[str]:
    """The complete shards in `output_dir`, in shard order (temporary files of an interrupted run are not listed)."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return []
    names = sorted((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _SHARD.fullmatch(name)))
    return [os.path.join(output_dir, name) for _, name in names]


def _ids_in_shard(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        try:
            return [str(json.loads(line)["id"]) for line in f if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a shard written by regenerate_responses: {error}") from error


def _unique_ids(conversations: list[dict]) -> list[dict]:
    """Give repeated ids a ``#k`` suffix (ShareGPT V3 repeats about 120 ids for different conversations).

    The suffix depends only on the input order, so a resumed run with the same input sees the same ids.
    """
    taken = {c["id"] for c in conversations}
    seen: Counter = Counter()
    unique, repeats = [], 0
    for conversation in conversations:
        original = conversation["id"]
        seen[original] += 1
        if seen[original] == 1:
            unique.append(conversation)
            continue
        repeats += 1
        while f"{original}#{seen[original] - 1}" in taken:  # never collide with an id the data already has
            seen[original] += 1
        new_id = f"{original}#{seen[original] - 1}"
        taken.add(new_id)
        unique.append({**conversation, "id": new_id})
    if repeats:
        logger.warning("%d conversations repeat an earlier id; they got a '#k' suffix.", repeats)
    return unique


def data_fingerprint(conversations: list[dict], max_rounds: int | None = None) -> str:
    """What identifies a data set: a digest of its first conversation (id and messages) and of `max_rounds`.

    The first one only, so that a run which continues or extends the same data (more conversations, or the next
    ones after ``--skip-conversations``) has the same fingerprint, while another data set has another."""
    first = [{"id": c["id"], "messages": c["messages"]} for c in conversations[:1]]
    text = json.dumps({"first": first, "max_rounds": max_rounds}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def regenerate_manifest(
    fingerprint: str,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    max_prompt_length: int,
    seed: int,
    enable_thinking: bool | None = None,
) -> dict:
    """The ``.regenerate.json`` of a run: its data and the settings its answers depend on (batch and shard sizes
    change only how the work is split). ``enable_thinking`` None (the template's default) is also what a manifest
    written before the setting was recorded means, so such a folder continues under the default."""
    return {
        "format": 1,
        "data": fingerprint,
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "temperature": temperature if do_sample else None,
        "seed": seed if do_sample else None,
        "max_prompt_length": max_prompt_length,
        "enable_thinking": enable_thinking,
    }


def regenerated_thinking_mismatch(source: object, enable_thinking: bool | None) -> str | None:
    """A warning when `source` is a folder written by `regenerate_responses` with another thinking setting than
    `enable_thinking` (the one a training run renders its conversations with); None otherwise, and for any other
    source (a file, a Hub id, a folder without a readable manifest: nothing records how it was made)."""
    path = os.path.join(source, MANIFEST_NAME) if isinstance(source, (str, os.PathLike)) else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # reading the data will say what is wrong with the folder, if anything
    recorded = manifest.get("enable_thinking") if isinstance(manifest, dict) else None
    return thinking_mismatch(
        recorded, enable_thinking, f"The answers in {os.fspath(source)!r} were regenerated", "this run renders them"
    )


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    # The end-of-turn token can differ from the tokenizer's eos (Llama 3), so stop on either.
    configured = model.generation_config.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


def _generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    generate_kwargs: dict,
    features: RegeneratedFeatures | None = None,
) -> list[str]:
    padded = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    input_ids = padded["input_ids"].to(model.device)
    attention_mask = padded["attention_mask"].to(model.device)
    if features is None:
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    else:  # the same generation, its forwards recorded
        output = features.decode.generate(model, input_ids, attention_mask, generate_kwargs)
    new_tokens = output[:, input_ids.shape[1] :]
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def _regenerate_shard(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[dict],
    batch_size: int,
    max_prompt_length: int,
    generate_kwargs: dict,
    progress: tqdm,
    enable_thinking: bool | None = None,
    features: RegeneratedFeatures | None = None,
) -> list[dict]:
    """Answer every round of every conversation, one round at a time across the shard so that answers batch;
    `features` keeps the latest round's features of each conversation."""
    rounds = [prompt_rounds(c["messages"]) for c in conversations]
    histories: list[list[dict]] = [[] for _ in conversations]
    active = [bool(r) for r in rounds]
    for step in range(max((len(r) for r in rounds), default=0)):
        queue = []
        for i, conversation_rounds in enumerate(rounds):
            if not active[i] or step >= len(conversation_rounds):
                continue
            messages = histories[i] + conversation_rounds[step]
            text = apply_chat_template(
                tokenizer, messages, enable_thinking=enable_thinking, tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_length:
                # Stop this conversation here: its later rounds would be longer still.
                active[i] = False
                progress.update(len(conversation_rounds) - step)
                continue
            queue.append((len(ids), i, ids))
        queue.sort(key=lambda item: item[0])  # similar lengths together: less padding
        for start in range(0, len(queue), batch_size):
            batch = queue[start : start + batch_size]
            answers = _generate_batch(model, tokenizer, [ids for _, _, ids in batch], generate_kwargs, features)
            for (_, i, _), answer in zip(batch, answers):
                histories[i] += rounds[i][step] + [{"role": "assistant", "content": answer}]
            if features is not None:
                features.keep([{"id": conversations[i]["id"], "messages": histories[i]} for _, i, _ in batch])
            progress.update(len(batch))
    return [
        {
            "id": conversation["id"],
            "conversations": [{"from": _SHAREGPT_SPEAKER[m["role"]], "value": m["content"]} for m in history],
        }
        for conversation, history in zip(conversations, histories)
        if history
    ]


def _write_shard(output_dir: str, index: int, records: list[dict]) -> str:
    path = os.path.join(output_dir, f"shard_{index:05d}.jsonl")
    temporary = os.path.join(output_dir, f".shard_{index:05d}.jsonl.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)  # atomic: the shard exists whole or not at all
    return path


def regenerate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations,
    output_dir: str | os.PathLike,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    do_sample: bool = False,
    temperature: float = 0.7,
    shard_size: int = 256,
    max_prompt_length: int = 2048,
    seed: int = 0,
    fingerprint: str | None = None,
    enable_thinking: bool | None = None,
    save_features: SaveFeatures | None = None,
) -> list[str]:
    """Regenerate the assistant turns of `conversations` with `model`; return the paths of all complete shards.

    Args:
        conversations: records in any format `eagle3_hf.training.data.read_conversations` accepts, or its output.
        output_dir: folder for the shards; conversations whose id is already in a complete shard there are skipped.
        batch_size: prompts per `generate` call, left-padded; prompts of a shard are sorted by length first.
        max_new_tokens: cap on each answer; an answer that hits it is kept as it is.
        do_sample, temperature: greedy answers by default; with sampling, shard ``k`` of a run draws from seed
            ``seed + k`` (so a resumed run reproduces sampled answers only when its shards hold the same ids).
        shard_size: conversations per shard, i.e. how much work a kill can lose.
        max_prompt_length: a conversation stops at the first round whose prompt is longer; if that is its first
            round it is left out of the output (and retried, cheaply, on a later run).
        fingerprint: what identifies the data set (`data_fingerprint` of the whole data, as `eagle3-hf regenerate`
            passes); default: `data_fingerprint(conversations)`. A folder holding answers to another data set, or
            made with other generation settings, is refused with a `ValueError`.
        enable_thinking: the chat template's thinking switch for the prompts (`eagle3_hf.modeling.chat_template`;
            None: the template's default), recorded in the manifest so that training can check it renders the
            answers the same way.
        save_features: also save the target's features of the answers (`SaveFeatures`: a folder for the training
            split, one for the held-out split), taken from the generation's own forward passes
            (`eagle3_hf.training.regenerate_features`), equal to what `eagle3-hf features` computes from the
            answers folder. A features shard is written with each answers shard; answers written earlier without
            features get theirs from one batched prefill when the run starts.

    The tokenizer's padding side is set to left (and its pad token to eos when it has none) during the call.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("max_new_tokens", max_new_tokens),
        ("shard_size", shard_size),
        ("max_prompt_length", max_prompt_length),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}.")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer {tokenizer.name_or_path!r} has no chat template; set `tokenizer.chat_template` first."
        )
    output_dir = os.fspath(output_dir)
    conversations = _unique_ids(as_conversations(conversations))
    manifest = regenerate_manifest(
        fingerprint or data_fingerprint(conversations),
        max_new_tokens,
        do_sample,
        temperature,
        max_prompt_length,
        seed,
        enable_thinking,
    )
    has_manifest = check_manifest(output_dir, MANIFEST_NAME, manifest, "answers")
    os.makedirs(output_dir, exist_ok=True)
    if not has_manifest:
        if list_shards(output_dir):  # written before manifests were: its prompts cannot be checked
            logger.warning("%s holds shards but no %s; continuing it as the same data.", output_dir, MANIFEST_NAME)
        write_manifest(output_dir, MANIFEST_NAME, manifest)
    for name in os.listdir(output_dir):
        if name.startswith(".shard_") and name.endswith(".jsonl.tmp"):
            os.remove(os.path.join(output_dir, name))  # left by a killed run; its conversations are redone

    existing = list_shards(output_dir)
    done = {i for path in existing for i in _ids_in_shard(path)}
    next_index = int(_SHARD.fullmatch(os.path.basename(existing[-1])).group(1)) + 1 if existing else 0
    pending = [c for c in conversations if c["id"] not in done]
    if done:
        logger.info(
            "Resuming: %d conversations already in %d shards, %d to go.", len(done), len(existing), len(pending)
        )

    features = None
    if save_features is not None:
        features = RegeneratedFeatures(
            save_features, model, tokenizer, _eos_ids(model, tokenizer), enable_thinking, output_dir
        )
        features.start(existing, shard_size, save_features.batch_size)
    generate_kwargs: dict = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "eos_token_id": _eos_ids(model, tokenizer),
    }
    if do_sample:
        generate_kwargs["temperature"] = temperature
    saved_side, saved_pad = tokenizer.padding_side, tokenizer.pad_token
    written = []
    try:
        tokenizer.padding_side = "left"  # generate appends on the right, so padding must sit on the left
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        generate_kwargs["pad_token_id"] = tokenizer.pad_token_id
        total = sum(len(prompt_rounds(c["messages"])) for c in pending)
        devices = [model.device] if model.device.type != "cpu" else []
        with torch.inference_mode(), tqdm(total=total, unit="answer", desc="Regenerating") as progress:
            for start in range(0, len(pending), shard_size):
                with torch.random.fork_rng(devices=devices, device_type=model.device.type):
                    torch.manual_seed(seed + next_index)
                    records = _regenerate_shard(
                        model,
                        tokenizer,
                        pending[start : start + shard_size],
                        batch_size,
                        max_prompt_length,
                        generate_kwargs,
                        progress,
                        enable_thinking,
                        features,
                    )
                if records:
                    if features is not None:  # before its answers: a kill between the two redoes the shard
                        features.write(next_index, records, shard_size)
                    written.append(_write_shard(output_dir, next_index, records))
                    if features is not None:
                        features.written()
                    next_index += 1
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved_side, saved_pad
    return existing + written


def _first_rounds(messages: list[dict], rounds: int) -> list[dict]:
    """Keep the messages up to (not including) the user turn that would start round `rounds + 1`."""
    kept, users = [], 0
    for message in messages:
        if message["role"] == "user":
            users += 1
            if users > rounds:
                break
        kept.append(message)
    return kept


def select_conversations(
    data: str, skip: int = 0, max_conversations: int | None = None, max_rounds: int | None = None
) -> list[dict]:
    """Read the conversations to regenerate: skip the first `skip`, keep `max_conversations`, cut to `max_rounds`."""
    limit = None if max_conversations is None else skip + max_conversations
    # Give repeated ids their `#k` suffixes before slicing, so that runs split by --skip-conversations agree.
    conversations = _unique_ids(read_conversations(data, limit=limit))[skip:]
    if max_rounds is not None:
        conversations = [dict(c, messages=_first_rounds(c["messages"], max_rounds)) for c in conversations]
    return conversations
