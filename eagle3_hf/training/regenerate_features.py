"""Target features saved while `regenerate_responses` answers: taken from the decode itself, no second forward.

`generate` runs the target over every prompt and answer token anyway; `DecodeFeatures` records the taps and top-k
logits of each of its forward passes (prefill and every decoding step). What the features folder must hold is what
`eagle3-hf features` computes for the same answer: the row of the finished conversation as training tokenises it
(`tokenize_conversation`: the answer text re-rendered with the chat template, cut to `max_length`). Its tokens agree
with the ones the target read up to some position p (usually through the answer's last content token); the features
there are the decode's. The rest is computed by one short forward over the KV cache of that same `generate` call:

* the off-by-one: the feature at position t is the state after reading token t, and the last generated token (the
  end-of-turn token, or the answer's last token when it hit ``max_new_tokens``) is never read by `generate`; nor are
  the template's tokens after it (ChatML's newline);
* any answer whose text re-tokenises differently (decoding drops special tokens, the answer is stripped): from the
  first token that differs on, the row's own tokens are read.

In a batch, prompts are left-padded and rows that finished early are fed padding: a row's positions are the columns
of its own prompt and its answer up to its end-of-turn token, and the cache columns of padding and of tokens after
p are masked out of the continuation. The result equals the separate prefill's features up to floating-point
rounding (a decoding step's matmuls are shaped differently), i.e. to the storage dtype's last bit.

Each features folder (the training split, or the held-out one for ``train --eval-features``) mirrors the answers
folder shard by shard: ``shard_0000k.safetensors`` holds the rows of the conversations in ``shard_0000k.jsonl`` that
belong to its split and keep a supervised token, in the same order, so that its rows are those `eagle3-hf features`
would write from the answers folder. A shard of features is written before its answers (a kill between the two
redoes that shard), and ``features.json`` after them; it records each shard's row count (``shard_samples``).
Answers already in the folder without features (a run started without them) get theirs from one batched prefill
pass when the run starts.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from eagle3_hf.modeling.modeling_eagle3 import select_target_features
from eagle3_hf.training.arguments import DEFAULT_HELD_OUT_FRACTION, DEFAULT_TOP_K
from eagle3_hf.training.data import read_conversations, tokenize_conversation
from eagle3_hf.training.features import (
    FEATURES_FORMAT,
    MANIFEST_NAME,
    feature_row,
    feature_settings,
    prefill_rows,
    row_digest,
    shard_path,
    write_feature_shard,
)
from eagle3_hf.training.manifest import check_manifest, write_manifest
from eagle3_hf.training.soft_labels import target_top_k
from eagle3_hf.training.split import split_filter
from eagle3_hf.utils.compat import CACHE_KWARG, cache_kwargs

__all__ = ["DecodeFeatures", "SaveFeatures"]

Row = dict[str, torch.Tensor]


@dataclass
class SaveFeatures:
    """Where and how `regenerate_responses` saves the target's features of the answers it writes.

    Args:
        output_dir: folder for the training split's features (conversations not held out), or None.
        eval_output_dir: folder for the held-out split's (``train --eval-features``), or None.
        held_out_fraction: share of conversations (by id hash) held out, as for `eagle3-hf features`.
        max_length: tokens per conversation (longer ones are cut), as `eagle3-hf features --max-length`.
        layer_ids: taps (``output_hidden_states`` indices); default ``[2, L//2, L-3]``.
        top_k: target logits kept per position.
        dtype: storage dtype.
        batch_size: conversations per forward of the prefill that computes features of answers written earlier
            without them.
    """

    output_dir: str | os.PathLike | None = None
    eval_output_dir: str | os.PathLike | None = None
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION
    max_length: int = 2048
    layer_ids: list[int] | None = None
    top_k: int = DEFAULT_TOP_K
    dtype: torch.dtype = torch.bfloat16
    batch_size: int = 8

    def folders(self) -> list[tuple[str, str]]:
        """``(folder, split)`` of each folder to write."""
        pairs = [(self.output_dir, "train"), (self.eval_output_dir, "held-out")]
        return [(os.fspath(folder), split) for folder, split in pairs if folder is not None]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class DecodeFeatures:
    """One `generate` call's features: `generate` records every forward's taps and top-k logits; `rows` turns them
    into the stored rows of the finished conversations (see the module docstring)."""

    def __init__(self, layer_ids: list[int], top_k: int, dtype: torch.dtype, eos_ids: list[int]) -> None:
        self.layer_ids, self.top_k, self.dtype, self.eos_ids = layer_ids, top_k, dtype, eos_ids
        # Positions of the stored rows taken from the generation's forwards / read by the continuation.
        self.decoded_positions, self.continued_positions = 0, 0

    def _ask(self, module: Any, args: Any, kwargs: dict) -> tuple[Any, dict]:
        """Before each forward of `generate`: ask for the hidden states and every position's logits (generate asks
        for the last position's only), and keep a handle on its cache (for the continuation)."""
        self.cache = kwargs.get(CACHE_KWARG, self.cache)
        return args, {**kwargs, "output_hidden_states": True, **self.all_logits}

    def _record(self, module: Any, args: Any, output: Any) -> None:
        features = select_target_features(output.hidden_states, self.layer_ids)
        values, ids = target_top_k(output.logits, self.top_k)
        self.steps.append((features.to("cpu", self.dtype), values.to("cpu", self.dtype), ids.cpu()))

    def generate(
        self, model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, generate_kwargs: dict
    ) -> torch.Tensor:
        """`model.generate` (left-padded prompts), recording its forwards; returns the sequences."""
        self.model, self.input_ids, self.attention_mask = model, input_ids.cpu(), attention_mask.cpu()
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.cache = None
        # A forward without `logits_to_keep` returns every position's logits anyway.
        self.all_logits = (
            {"logits_to_keep": 0} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        )
        handles = [
            model.register_forward_pre_hook(self._ask, with_kwargs=True),
            model.register_forward_hook(self._record),
        ]
        try:
            sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if self.cache is None:
            raise ValueError(f"{type(model).__name__}.generate ran without a KV cache; saving features needs one.")
        self.sequences = sequences.cpu()
        return sequences

    def _read(self, r: int) -> tuple[list[int], tuple[torch.Tensor, ...]]:
        """Row `r`'s tokens the target read (its prompt, its answer but the last token) and their features."""
        width = self.input_ids.shape[1]
        start = width - int(self.attention_mask[r].sum())
        answer = self.sequences[r, width:].tolist()
        end = next((i + 1 for i, t in enumerate(answer) if t in self.eos_ids), len(answer))
        read = self.input_ids[r, start:].tolist() + answer[: end - 1]
        # Forward 0 is the prefill (every prompt column); forward j >= 1 read the answer's token j-1.
        parts = [
            torch.cat([self.steps[0][i][r, start:], *(self.steps[j][i][r] for j in range(1, end))]) for i in range(3)
        ]
        return read, tuple(parts)

    @torch.no_grad()
    def rows(self, wanted: list[tuple[list[int], list[int]] | None]) -> list[Row | None]:
        """The stored row of each batch row from its training tokens ``(input_ids, loss_mask)`` (None: not wanted)."""
        reads = [self._read(r) if w is not None else None for r, w in enumerate(wanted)]
        agree = [
            min(_common_prefix(read[0], w[0]), len(w[0])) if w is not None else 0
            for read, w in zip(reads, wanted, strict=True)
        ]
        rest = [len(w[0]) - p if w is not None else 0 for w, p in zip(wanted, agree, strict=True)]
        tails = self._continue(wanted, agree, rest) if max(rest) > 0 else None
        self.decoded_positions += sum(agree)
        self.continued_positions += sum(rest)
        out: list[Row | None] = []
        for r, w in enumerate(wanted):
            if w is None:
                out.append(None)
                continue
            parts = [part[: agree[r]] for part in reads[r][1]]
            if rest[r]:
                parts = [torch.cat([part, tail[r, : rest[r]]]) for part, tail in zip(parts, tails, strict=True)]
            out.append(feature_row(*w, *parts, self.dtype))
        self.steps, self.cache = [], None
        return out

    def _continue(
        self, wanted: list[tuple[list[int], list[int]] | None], agree: list[int], rest: list[int]
    ) -> tuple[torch.Tensor, ...]:
        """One forward over the cache: row r reads its training tokens from `agree[r]` on, attending to the cache
        columns of its first `agree[r]` positions only."""
        width, cached = self.input_ids.shape[1], self.cache.get_seq_length()
        batch, new = len(wanted), max(rest)
        input_ids = torch.zeros(batch, new, dtype=torch.long)
        mask = torch.zeros(batch, cached + new, dtype=torch.long)
        positions = torch.tensor(agree)[:, None] + torch.arange(new)  # padding columns get positions too: unread
        for r, w in enumerate(wanted):
            start = width - int(self.attention_mask[r].sum())
            # A row not stored attends to its prompt, so that no row of the attention is masked whole.
            mask[r, start : start + agree[r] if w is not None else width] = 1
            mask[r, cached : cached + rest[r]] = 1
            if rest[r]:
                input_ids[r, : rest[r]] = torch.tensor(w[0][agree[r] :])
        device = self.model.device
        out = self.model(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            **cache_kwargs(self.cache),
            output_hidden_states=True,
        )
        features = select_target_features(out.hidden_states, self.layer_ids)
        values, ids = target_top_k(out.logits, self.top_k)
        return features.to("cpu", self.dtype), values.to("cpu", self.dtype), ids.cpu()


class _FeatureFolder:
    """One features folder written next to the answers: its settings, and the rows and fingerprint so far."""

    def __init__(self, folder: str, split: str, settings: dict[str, Any], save: SaveFeatures) -> None:
        self.folder, self.split = folder, split
        self.select = split_filter(split, save.held_out_fraction)
        # What the rows depend on; the counts and the fingerprint grow as answers are added.
        self.settings = {
            "format": FEATURES_FORMAT,
            "source": "regenerate",
            "split": split,
            "held_out_fraction": save.held_out_fraction,
            "max_length": save.max_length,
            **settings,
        }
        if not check_manifest(folder, MANIFEST_NAME, self.settings, "features", ignore=("target",)):
            if os.path.isdir(folder) and any(n.startswith("shard_") for n in os.listdir(folder)):
                raise ValueError(f"{folder!r} holds shards but no {MANIFEST_NAME}; use an empty folder.")
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.startswith(".shard_") and name.endswith(".tmp"):
                os.remove(os.path.join(folder, name))  # left by a killed run
        self.counts: list[int] = []
        self.tokens = 0
        self.digest = hashlib.sha256()

    def add(self, index: int, rows: list[Row], shard_size: int) -> None:
        """Write shard `index` (the next one) of `rows`, counting them."""
        empty = {"width": 3 * self.settings["target_hidden_size"], "top_k": self.settings["logits_top_k"]}
        empty["dtype"] = getattr(torch, self.settings["dtype"])
        write_feature_shard(self.folder, index, rows, sum(self.counts), empty)
        self.counted(rows, shard_size)

    def counted(self, rows: list[dict[str, torch.Tensor]], shard_size: int) -> None:
        """Count a shard's rows (``input_ids``, ``loss_mask``) into the totals and the fingerprint."""
        for row in rows:
            row_digest(self.digest, row["input_ids"].tolist(), row["loss_mask"].tolist())
            self.tokens += row["input_ids"].numel()
        self.counts.append(len(rows))
        self.shard_size = shard_size

    def write_manifest(self) -> None:
        write_manifest(
            self.folder,
            MANIFEST_NAME,
            {
                **self.settings,
                "num_samples": sum(self.counts),
                "num_tokens": self.tokens,
                "shard_size": self.shard_size,
                "num_shards": len(self.counts),
                "shard_samples": self.counts,
                "fingerprint": self.digest.hexdigest(),
            },
        )


class RegeneratedFeatures:
    """The features folders of one `regenerate_responses` run: the rows of the current shard's conversations (the
    latest round of each), written next to each answers shard."""

    def __init__(
        self,
        save: SaveFeatures,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: list[int],
        enable_thinking: bool | None,
        answers_dir: str,
    ) -> None:
        if save.max_length < 3:
            raise ValueError(f"max_length must be >= 3 (the draft predicts tokens two ahead), got {save.max_length}.")
        folders = save.folders()
        if not folders:
            raise ValueError("SaveFeatures names no folder: give output_dir, eval_output_dir or both.")
        names = [os.path.abspath(answers_dir)] + [os.path.abspath(folder) for folder, _ in folders]
        if len(set(names)) < len(names):
            raise ValueError(f"The answers and each split's features need folders of their own, got {names}.")
        settings = feature_settings(model, save.layer_ids, save.top_k, save.dtype, enable_thinking)
        self.save, self.model, self.tokenizer, self.enable_thinking = save, model, tokenizer, enable_thinking
        self.folders = [_FeatureFolder(folder, split, settings, save) for folder, split in folders]
        self.decode = DecodeFeatures(settings["layer_ids"], settings["logits_top_k"], save.dtype, eos_ids)
        self.rows: dict[str, Row] = {}  # conversation id -> its row so far, in this shard

    def _tokens(self, messages: list[dict]) -> tuple[list[int], list[int]] | None:
        row = tokenize_conversation(self.tokenizer, messages, self.save.max_length, self.enable_thinking)
        # `build_dataset` drops a conversation without a supervised token within max_length: so is it here.
        return (row["input_ids"], row["loss_mask"]) if any(row["loss_mask"]) else None

    def wanted(self, conversation: dict) -> bool:
        return any(folder.select is None or folder.select(conversation) for folder in self.folders)

    def keep(self, conversations: list[dict]) -> None:
        """After `self.decode.generate`: the rows of its batch's conversations (``{"id", "messages"}``, the
        messages through the new answer), replacing their earlier rounds' rows."""
        wanted = [self._tokens(c["messages"]) if self.wanted(c) else None for c in conversations]
        for conversation, row in zip(conversations, self.decode.rows(wanted), strict=True):
            self.rows.pop(conversation["id"], None)
            if row is not None:
                self.rows[conversation["id"]] = row

    def _write(self, index: int, records: list[dict], rows: dict[str, Row], shard_size: int) -> None:
        for folder in self.folders:
            chosen = [rows[r["id"]] for r in records if r["id"] in rows and (folder.select is None or folder.select(r))]
            folder.add(index, chosen, shard_size)

    def write(self, index: int, records: list[dict], shard_size: int) -> None:
        """Write features shard `index` of every folder: the rows of `records`' conversations, in their order."""
        self._write(index, records, self.rows, shard_size)
        self.rows = {}

    def written(self) -> None:
        """After an answers shard is written: the manifests count it."""
        for folder in self.folders:
            folder.write_manifest()

    def start(self, answer_shards: list[str], shard_size: int, batch_size: int) -> None:
        """Take stock of the answers shards already written: count their features, or compute them (one batched
        prefill pass over those answers) where a folder lacks them; then write the manifests."""
        names = [os.path.basename(path) for path in answer_shards]
        if names != [f"shard_{k:05d}.jsonl" for k in range(len(names))]:
            raise ValueError(
                f"Saving features needs the answers shards numbered from 0 without gaps; the folder holds {names}."
            )
        missing = [
            k for k in range(len(names)) if not all(os.path.isfile(shard_path(f.folder, k)) for f in self.folders)
        ]
        records = {k: read_conversations(answer_shards[k]) for k in missing}
        pending = [(k, c) for k in missing for c in records[k] if self.wanted(c)]
        with tqdm(total=len(pending), unit="answer", desc="Features of earlier answers", disable=not pending) as bar:
            for k in range(len(names)):
                if k in records:
                    wanted = [(c["id"], self._tokens(c["messages"])) for c in records[k] if self.wanted(c)]
                    kept = [(i, t) for i, t in wanted if t is not None]
                    rows = prefill_rows(
                        self.model,
                        [t for _, t in kept],
                        self.decode.layer_ids,
                        self.decode.top_k,
                        self.save.dtype,
                        batch_size,
                        bar,
                    )
                    bar.update(len(wanted) - len(kept))
                    self._write(k, records[k], dict(zip([i for i, _ in kept], rows, strict=True)), shard_size)
                else:
                    for folder in self.folders:
                        folder.counted(_stored_rows(shard_path(folder.folder, k)), shard_size)
        for folder in self.folders:
            folder.shard_size = shard_size
        self.written()


def _stored_rows(path: str) -> list[dict[str, torch.Tensor]]:
    """The ``input_ids`` and ``loss_mask`` of each row of a features shard."""
    with safe_open(path, framework="pt") as f:
        ids, mask, offsets = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets"))
    bounds = offsets.tolist()
    return [{"input_ids": ids[a:b], "loss_mask": mask[a:b]} for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
