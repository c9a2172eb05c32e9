"""Target features for training: computed online from the frozen target, or precomputed to safetensors shards.

A training batch carries, besides ``input_ids`` / ``attention_mask`` / ``loss_mask``:

* ``target_hidden_states`` ``[B, S, 3*Ht]``: the target's low|mid|high taps at each position;
* ``target_top_logits`` ``[B, S, k]`` and ``target_top_ids`` ``[B, S, k]``: the target's k largest logits over its
  FULL vocabulary and their ids (`eagle3_hf.training.ttt.target_top_k`; column 0 is its top token).

All are zero on padding, so online and offline batches are the same tensors. The top-k logits are all the loss needs:
its soft label is their softmax restricted to the draft vocabulary's ids, and its accuracy compares with the
full-vocabulary top token. They do not depend on a draft vocabulary, so one feature folder serves any draft
vocabulary, and they are small: ``3*Ht + k`` values and ``k`` int32 ids per token (a draft-vocabulary logit row was
8,192-32,768 values).

Folder layout: ``features.json`` (manifest) and ``shard_00000.safetensors`` ... each holding the concatenated rows of
``shard_size`` samples (``input_ids``, ``loss_mask``, ``features``, ``top_logits``, ``top_ids`` and row ``offsets``).
A shard is written to a temporary name and renamed, so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from datasets import Dataset
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from eagle3_hf.modeling.configuration_eagle3 import default_target_layer_ids
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, select_target_features
from eagle3_hf.training.arguments import DEFAULT_TOP_K
from eagle3_hf.training.distributed import barrier, distributed_rank
from eagle3_hf.training.manifest import check_manifest, write_manifest
from eagle3_hf.training.ttt import target_top_k
from eagle3_hf.utils.atomic import replace_path

logger = logging.getLogger(__name__)

MANIFEST_NAME = "features.json"
# Format 1 stored logits restricted to one draft vocabulary: its top token was the best in-vocabulary one, not the
# target's, so accuracies read from it overstate acceptance. It is refused, not converted.
FEATURES_FORMAT = "eagle3_hf.features/2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["estimate_feature_bytes", "online_features", "precompute_features"]


def _base_draft(draft: Any) -> Eagle3DraftModel:
    """The draft under a PEFT wrapper (LoRA), or the draft itself."""
    return draft.get_base_model() if hasattr(draft, "get_base_model") else draft


@torch.no_grad()
def _target_forward(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    taps: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
    top_k: int,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one target pass of online training and offline features: ``(taps, top-k logits, top-k ids)``. With
    `position_ids` (packed rows) the target gets them and no attention mask: HF builds the packed rows' block-diagonal
    mask from the restarting positions; `attention_mask` then only zeroes the padding's features."""
    kwargs = {"attention_mask": attention_mask} if position_ids is None else {"position_ids": position_ids}
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False, **kwargs)
    features = taps(out.hidden_states)  # [B, S, 3Ht]
    top_logits, top_ids = target_top_k(out.logits, top_k)  # [B, S, k] x2
    if attention_mask is not None:  # zero on padding: online batches then equal the zero-padded offline ones
        keep = attention_mask[..., None].bool()
        features, top_logits, top_ids = features * keep, top_logits * keep, top_ids * keep
    return features, top_logits, top_ids


def online_features(
    target: PreTrainedModel,
    draft: Eagle3DraftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    top_k: int = DEFAULT_TOP_K,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the frozen `target` without gradients: ``(target_hidden_states [B, S, 3Ht], target_top_logits [B, S, k],
    target_top_ids [B, S, k])``; `position_ids` for packed rows (each conversation from 0), which it attends within.

    The taps are the draft's (`draft.target_features`, i.e. its config's layer ids); the logits are the target's
    `top_k` largest over its full vocabulary, exactly what offline features store; all are zero on padding. The
    target should be in eval mode; a PEFT-wrapped target gives the adapted features.

    Example:

    ```python
    >>> features, top_logits, top_ids = online_features(target, draft, batch["input_ids"])  # doctest: +SKIP
    ```
    """
    draft = _base_draft(draft)
    return _target_forward(target, input_ids, attention_mask, draft.target_features, top_k, position_ids)


# ------------------------------------------------------------------------------------------------------------------
# offline: precompute to shards
# ------------------------------------------------------------------------------------------------------------------


class _TokenRows:
    """Random access to the ``(input_ids, loss_mask)`` of tokenised rows without copying a `datasets.Dataset`."""

    def __init__(self, dataset: Iterable[Mapping]) -> None:
        if isinstance(dataset, Dataset):
            missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
            if missing:
                raise ValueError(f"The dataset lacks the column(s) {sorted(missing)}; it has {dataset.column_names}.")
            dataset = dataset.select_columns(["input_ids", "loss_mask"])
        elif not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            dataset = list(dataset)
        self.data = dataset
        if len(self.data) == 0:
            raise ValueError("The dataset is empty: there is nothing to precompute.")

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        row = self.data[index]
        if "input_ids" not in row or "loss_mask" not in row:
            raise ValueError(
                f"Row {index} has keys {sorted(row)}; expected tokenised rows with input_ids and loss_mask."
            )
        ids, mask = [int(i) for i in row["input_ids"]], [int(m) for m in row["loss_mask"]]
        if len(ids) != len(mask) or not ids:
            raise ValueError(
                f"Row {index} has {len(ids)} input_ids and {len(mask)} loss_mask values; expected equal, > 0."
            )
        return ids, mask


def estimate_feature_bytes(
    num_tokens: int, target_hidden_size: int, top_k: int, dtype: torch.dtype, num_samples: int = 0
) -> int:
    """Bytes the shards of `num_tokens` tokens take: taps and top-k logits in `dtype`, int32 top-k ids, int64 token
    ids, uint8 mask."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = (3 * target_hidden_size + top_k) * element + 4 * top_k + 8 + 1
    return num_tokens * per_token + 8 * num_samples + 4096  # offsets and the safetensors headers


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def shard_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"shard_{index:05d}.safetensors")


def feature_settings(
    target: PreTrainedModel,
    layer_ids: list[int] | None,
    top_k: int,
    dtype: torch.dtype,
    enable_thinking: bool | None,
) -> dict[str, Any]:
    """The manifest entries that say what a features folder's rows are (taps, logits kept, storage dtype, target),
    checked and with defaults filled in: `layer_ids` None is ``[2, L//2, L-3]``, `top_k` is capped at the
    vocabulary size. Raises `ValueError` naming a bad value."""
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}.")
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}.")
    text = target.config.get_text_config()
    layer_ids = list(layer_ids) if layer_ids is not None else default_target_layer_ids(text.num_hidden_layers)
    if len(layer_ids) != 3 or not all(0 <= i <= text.num_hidden_layers for i in layer_ids):
        raise ValueError(f"layer_ids must be three indices in [0, {text.num_hidden_layers}], got {layer_ids}.")
    return {
        "layer_ids": layer_ids,
        "target_hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "logits_top_k": min(top_k, text.vocab_size),
        "dtype": next(k for k, v in _DTYPES.items() if v == dtype),
        "target": getattr(target.config, "_name_or_path", None) or None,
        "enable_thinking": enable_thinking,
    }


def precompute_features(
    target: PreTrainedModel,
    dataset: Iterable[Mapping],
    output_dir: str | os.PathLike,
    layer_ids: list[int] | None = None,
    shard_size: int = 256,
    top_k: int = DEFAULT_TOP_K,
    dtype: torch.dtype = torch.bfloat16,
    batch_size: int = 1,
    enable_thinking: bool | None = None,
) -> list[str]:
    """Run `target` over tokenised rows and write the features to safetensors shards in `output_dir`.

    Args:
        dataset: rows with ``input_ids`` and ``loss_mask`` (e.g. `eagle3_hf.training.data.build_dataset`'s output).
        layer_ids: taps as indices into ``output_hidden_states``; default ``[2, L//2, L-3]``.
        shard_size: samples per shard (the unit of resumption).
        top_k: target logits kept per position: the `top_k` largest over the full vocabulary, with their ids
            (capped at the vocabulary size). Train with the same `logits_top_k` online for the same soft labels.
        dtype: storage dtype of taps and logits (bfloat16 halves the disk; float32 reproduces online features).
        batch_size: rows per target forward (rows of similar lengths together, right-padded; each row is stored at
            its own length).
        enable_thinking: the chat template's thinking switch the rows were rendered with (None: its default),
            recorded in the manifest for `eagle3-hf train` to record in turn; the rows' fingerprint already tells
            their data apart, so a rerun is not checked against it.

    The disk size is estimated and printed first; if the free space cannot hold what remains to be written a
    `ValueError` is raised before anything is written. Rerunning with the same arguments skips complete shards;
    a folder holding features of other data or settings is refused. Returns the shard paths.

    In an initialised torch.distributed group (`eagle3-hf features` under torchrun), every process runs this with the
    same arguments: process r of N writes every N-th missing shard, process 0 the manifest, and each
    returns once the folder is complete; it equals what one process writes.

    Example:

    ```python
    >>> from eagle3_hf.training.features import precompute_features
    >>> from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
    >>> paths = precompute_features(target, dataset, "features/", top_k=64)  # doctest: +SKIP
    >>> OfflineFeatureDataset("features/")[0]["target_hidden_states"].shape  # doctest: +SKIP
    torch.Size([412, 1728])
    ```
    """
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    output_dir = os.fspath(output_dir)
    settings = feature_settings(target, layer_ids, top_k, dtype, enable_thinking)
    layer_ids, top_k, hidden, dtype_name = (
        settings["layer_ids"],
        settings["logits_top_k"],
        settings["target_hidden_size"],
        settings["dtype"],
    )
    rows = _TokenRows(dataset)
    digest, lengths = hashlib.sha256(), []  # one streaming pass: row lengths and a fingerprint of the data
    for index in range(len(rows)):
        ids, mask = rows[index]
        lengths.append(len(ids))
        row_digest(digest, ids, mask)
    manifest = {
        "format": FEATURES_FORMAT,
        "num_samples": len(rows),
        "num_tokens": sum(lengths),
        "shard_size": shard_size,
        "num_shards": math.ceil(len(rows) / shard_size),
        **settings,
        "fingerprint": digest.hexdigest(),
    }
    has_manifest = check_manifest(output_dir, MANIFEST_NAME, manifest, "features", ignore=("target", "enable_thinking"))
    if not has_manifest and os.path.isdir(output_dir) and any(n.startswith("shard_") for n in os.listdir(output_dir)):
        raise ValueError(f"{output_dir!r} holds shards but no {MANIFEST_NAME}; use an empty folder.")

    spans = [(k * shard_size, min((k + 1) * shard_size, len(rows))) for k in range(manifest["num_shards"])]
    pending = [k for k in range(len(spans)) if not os.path.isfile(shard_path(output_dir, k))]
    pending_tokens = sum(sum(lengths[slice(*spans[k])]) for k in pending)
    pending_samples = sum(spans[k][1] - spans[k][0] for k in pending)
    total = estimate_feature_bytes(manifest["num_tokens"], hidden, top_k, dtype, len(rows))
    needed = estimate_feature_bytes(pending_tokens, hidden, top_k, dtype, pending_samples)
    free = shutil.disk_usage(_existing_parent(output_dir)).free
    rank, world_size = distributed_rank()
    if rank == 0:
        print(
            f"Offline features: {len(rows)} samples, {manifest['num_tokens']} tokens, about {_fmt_bytes(total)} in "
            f"{dtype_name}, {_fmt_bytes(total / max(manifest['num_tokens'], 1))} a token with the top {top_k} logits "
            f"({len(pending)} of {len(spans)} shards, {_fmt_bytes(needed)}, still to write); "
            f"{_fmt_bytes(free)} free in {_existing_parent(output_dir)}."
        )
    if needed > free:
        raise ValueError(
            f"Not enough disk for the offline features: about {_fmt_bytes(needed)} are needed in {output_dir!r} but "
            f"only {_fmt_bytes(free)} are free. Use a smaller --logits-top-k, bfloat16, fewer or shorter samples, "
            "another folder, or online features (no disk)."
        )
    barrier()  # every process has checked the folder before the first one changes it
    os.makedirs(output_dir, exist_ok=True)
    if rank == 0 and not has_manifest:
        write_manifest(output_dir, MANIFEST_NAME, manifest)  # a manifest means the folder is set up
    for name in os.listdir(output_dir):
        if rank == 0 and name.startswith(".shard_") and name.endswith(".tmp"):
            os.remove(os.path.join(output_dir, name))  # left by a killed run
    barrier()  # the folder is set up before any process writes a shard
    was_training = target.training
    target.eval()
    try:
        # Process r of n writes every n-th missing shard: shards are named by their place in the data set, so the
        # folder is the same whichever process wrote which shard.
        mine = pending[rank::world_size]
        _write_shards(target, rows, spans, mine, output_dir, layer_ids, top_k, dtype, batch_size)
    finally:
        target.train(was_training)
    barrier()  # the folder is complete when any process returns
    return [shard_path(output_dir, k) for k in range(len(spans))]


def row_digest(digest: Any, ids: list[int], mask: list[int]) -> None:
    """Add one row to a folder's fingerprint (sha256 over every row's ids, -1, loss mask, in order)."""
    digest.update(torch.tensor([*ids, -1, *mask], dtype=torch.int64).numpy().tobytes())


def prefill_rows(
    target: PreTrainedModel,
    rows: list[tuple[list[int], list[int]]],
    layer_ids: list[int],
    top_k: int,
    dtype: torch.dtype,
    batch_size: int,
    progress: Any = None,
) -> list[dict[str, torch.Tensor]]:
    """The features of token rows ``(input_ids, loss_mask)``, one dict per row in the given order (`feature_row`'s
    keys), from batched target forwards: rows of similar lengths share a batch (right-padded) so that little of it is
    padding. `progress` (a tqdm bar) advances by the rows of each batch."""
    device = next(target.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))  # similar lengths together: less padding
    out: list[dict[str, torch.Tensor] | None] = [None] * len(rows)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(rows[i][0]) for i in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, i in enumerate(chunk):
            input_ids[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
            attention[r, : len(rows[i][0])] = 1
        features, top_logits, top_ids = _target_forward(
            target,
            input_ids.to(device),
            attention.to(device) if len(chunk) > 1 else None,
            lambda hidden_states: select_target_features(hidden_states, layer_ids),
            top_k,
        )
        for r, i in enumerate(chunk):
            n = len(rows[i][0])
            out[i] = feature_row(*rows[i], features[r, :n], top_logits[r, :n], top_ids[r, :n], dtype)
        if progress is not None:
            progress.update(len(chunk))
    return out  # type: ignore[return-value]


def feature_row(
    ids: list[int],
    mask: list[int],
    features: torch.Tensor,
    top_logits: torch.Tensor,
    top_ids: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One stored row: its tokens, loss mask, taps and top-k logits (in the storage `dtype`) and int32 top-k ids."""
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "features": features.to("cpu", dtype),
        "top_logits": top_logits.to("cpu", dtype),
        "top_ids": top_ids.to("cpu", torch.int32),
    }


def write_feature_shard(
    output_dir: str, index: int, rows: list[dict[str, torch.Tensor]], first_sample: int, empty: dict[str, Any]
) -> str:
    """Write `rows` (`feature_row` dicts) as shard `index`, whole or not at all (a temporary name renamed). A shard
    without rows (possible in `eagle3_hf.training.regenerate_features` folders) holds empty tensors shaped by
    `empty` (``{"width": 3*Ht, "top_k": k, "dtype": storage dtype}``)."""
    if rows:
        tensors = {key: torch.cat([row[key] for row in rows]).contiguous() for key in rows[0]}
    else:
        tensors = {
            "input_ids": torch.zeros(0, dtype=torch.int64),
            "loss_mask": torch.zeros(0, dtype=torch.uint8),
            "features": torch.zeros(0, empty["width"], dtype=empty["dtype"]),
            "top_logits": torch.zeros(0, empty["top_k"], dtype=empty["dtype"]),
            "top_ids": torch.zeros(0, empty["top_k"], dtype=torch.int32),
        }
    lengths = [row["input_ids"].numel() for row in rows]
    tensors["offsets"] = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    temporary = os.path.join(output_dir, f".shard_{index:05d}.tmp")
    save_file(tensors, temporary, metadata={"first_sample": str(first_sample), "num_samples": str(len(rows))})
    path = shard_path(output_dir, index)
    replace_path(temporary, path)  # atomic: a shard exists whole or not at all
    return path


def _write_shards(
    target: PreTrainedModel,
    rows: _TokenRows,
    spans: list[tuple[int, int]],
    pending: list[int],
    output_dir: str,
    layer_ids: list[int],
    top_k: int,
    dtype: torch.dtype,
    batch_size: int,
) -> None:
    pending_samples = sum(spans[k][1] - spans[k][0] for k in pending)
    with tqdm(total=pending_samples, unit="sample", desc="Precomputing target features") as progress:
        for k in pending:
            chunk = [rows[i] for i in range(*spans[k])]
            computed = prefill_rows(target, chunk, layer_ids, top_k, dtype, batch_size, progress)
            write_feature_shard(output_dir, k, computed, spans[k][0], {})
