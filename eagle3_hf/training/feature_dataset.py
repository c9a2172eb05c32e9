"""Reading precomputed target features back: the offline training data set over `precompute_features` folders.

The folder layout (manifest, atomically written shards) is described in `eagle3_hf.training.features`, which writes
it (`eagle3_hf.training.regenerate_features` writes the same layout while it regenerates answers); a folder is read only when its manifest names that format and every
shard is present, and several folders are joined only when they tap the same layers and keep as many target logits.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch.utils.data import Dataset as TorchDataset

from eagle3_hf.modeling.checkpoints import open_safetensors
from eagle3_hf.training.features import FEATURES_FORMAT, MANIFEST_NAME, shard_path

__all__ = ["OfflineFeatureDataset"]


class _FeatureFolder:
    """One folder written by `precompute_features`: its manifest and row offsets per shard."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = os.fspath(folder)
        path = os.path.join(self.folder, MANIFEST_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{self.folder!r} holds no {MANIFEST_NAME}: it is not a folder written by precompute_features."
            )
        with open(path, encoding="utf-8") as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FEATURES_FORMAT:
            raise ValueError(
                f"{path} has format {self.manifest.get('format')!r}, expected {FEATURES_FORMAT!r}: these features "
                "were written by an older version, which kept only draft-vocabulary logits (so no full-vocabulary "
                "accuracy). Re-run `eagle3-hf features` into a new folder."
            )
        missing = [k for k in range(self.manifest["num_shards"]) if not os.path.isfile(shard_path(self.folder, k))]
        if missing:
            raise ValueError(
                f"{self.folder!r} is incomplete: {len(missing)} of {self.manifest['num_shards']} shards are missing "
                f"(first: {os.path.basename(shard_path(self.folder, missing[0]))}); rerun the same precompute to "
                "finish it."
            )
        for k in range(self.manifest["num_shards"]):
            with open_safetensors(shard_path(self.folder, k)):  # a truncated shard fails here, not mid-training
                pass
        self.offsets: dict[int, list[int]] = {}
        # Folders written while regenerating hold as many rows per shard as their answers kept ("shard_samples");
        # `precompute_features` writes `shard_size` rows to each shard but the last.
        counts = self.manifest.get("shard_samples")
        self.shard_starts = [0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()] if counts else None

    def row(self, index: int) -> dict[str, torch.Tensor]:
        if self.shard_starts is None:
            shard, local = divmod(index, int(self.manifest["shard_size"]))
        else:
            shard = bisect.bisect_right(self.shard_starts, index) - 1
            local = index - self.shard_starts[shard]
        with safe_open(shard_path(self.folder, shard), framework="pt") as f:
            if shard not in self.offsets:
                self.offsets[shard] = f.get_tensor("offsets").tolist()
            start, end = self.offsets[shard][local], self.offsets[shard][local + 1]
            return {
                key: f.get_slice(key)[start:end]
                for key in ("input_ids", "loss_mask", "features", "top_logits", "top_ids")
            }

    def token_rows(self) -> Iterator[dict[str, list[int]]]:
        """``{"input_ids", "loss_mask"}`` of every row in order (lists), reading only those tensors of each shard."""
        for shard in range(int(self.manifest["num_shards"])):
            with safe_open(shard_path(self.folder, shard), framework="pt") as f:
                ids, mask, offsets = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets"))
            for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                yield {"input_ids": ids[start:end].tolist(), "loss_mask": mask[start:end].tolist()}


# Manifest entries that must agree for folders to be read as one data set.
_JOINABLE_KEYS = ("layer_ids", "target_hidden_size", "vocab_size", "logits_top_k")


class OfflineFeatureDataset(TorchDataset):
    """Rows of one or more folders written by `precompute_features`, as tensors ready for `Eagle3DataCollator`.

    Each row holds ``input_ids`` ``[S]``, ``attention_mask`` ``[S]``, ``loss_mask`` ``[S]``, ``target_hidden_states``
    ``[S, 3*Ht]``, ``target_top_logits`` ``[S, k]`` (in the stored dtype) and ``target_top_ids`` ``[S, k]`` (int32).
    Several folders (say, features of new data added next to older ones) are joined in the order given; they must
    tap the same layers and keep the same number of logits. Any draft vocabulary can train on them. Attributes:
    ``folders``, ``folder`` (their names joined, for messages), ``manifest`` (the first folder's), ``layer_ids``,
    ``top_k``.

    Example:

    ```python
    >>> data = OfflineFeatureDataset(["features/", "features_more/"])  # doctest: +SKIP
    >>> vocab = build_draft_vocab(data.token_rows(), target_vocab_size, 16384)  # doctest: +SKIP
    ```
    """

    def __init__(self, folder: str | os.PathLike | Iterable[str | os.PathLike]) -> None:
        names = [folder] if isinstance(folder, (str, os.PathLike)) else list(folder)
        if not names:
            raise ValueError("OfflineFeatureDataset needs at least one features folder, got none.")
        self._parts = [_FeatureFolder(name) for name in names]
        first = self._parts[0]
        for part in self._parts[1:]:
            differ = [k for k in _JOINABLE_KEYS if part.manifest.get(k) != first.manifest.get(k)]
            if differ:
                what = ", ".join(f"{k} {first.manifest.get(k)!r} vs {part.manifest.get(k)!r}" for k in differ)
                raise ValueError(
                    f"The features in {part.folder!r} cannot be joined to those in {first.folder!r}: {what}."
                )
        self.folders = [part.folder for part in self._parts]
        self.folder = ", ".join(self.folders)
        self.manifest = first.manifest
        self.manifests = [part.manifest for part in self._parts]  # each folder's, in order
        self.layer_ids: list[int] = list(first.manifest["layer_ids"])
        self.top_k = int(first.manifest["logits_top_k"])
        self._starts = [0]  # index of each folder's first row in the joined data set
        for part in self._parts:
            self._starts.append(self._starts[-1] + int(part.manifest["num_samples"]))

    def __len__(self) -> int:
        return self._starts[-1]

    def token_rows(self) -> Iterator[dict[str, list[int]]]:
        """The ``input_ids`` and ``loss_mask`` of every row, in order (what a draft vocabulary is counted from)."""
        for part in self._parts:
            yield from part.token_rows()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} samples.")
        index %= len(self)
        k = bisect.bisect_right(self._starts, index) - 1
        row = self._parts[k].row(index - self._starts[k])
        return {
            "input_ids": row["input_ids"].long(),
            "attention_mask": torch.ones(row["input_ids"].shape[0], dtype=torch.long),
            "loss_mask": row["loss_mask"].long(),
            "target_hidden_states": row["features"],
            "target_top_logits": row["top_logits"],
            "target_top_ids": row["top_ids"],
        }
