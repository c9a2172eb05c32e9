"""Whether a local folder holds a draft checkpoint's files, checked without torch and without reading a weight.

The command line runs this on a `--draft` or `SRC` folder before it loads the target (which takes seconds to tens of
seconds), so that an empty folder, an unfinished save or a truncated file is answered at once. It reads
``config.json`` and a safetensors file's header only; reading the weights, and every finer check, is
`eagle3_hf.modeling.checkpoint_files`'.
"""

from __future__ import annotations

import json
import os
import struct

__all__ = ["WEIGHT_FILES", "check_checkpoint_folder"]

# Looked up in this order; a single file wins over a stale index of an older sharded save in the same folder.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_checkpoint_folder(folder: str | os.PathLike, what: str = "--draft") -> None:
    """Raise `ValueError` (naming `what` and the folder) unless `folder` holds a readable ``config.json`` (a JSON
    object) and weights: one of `WEIGHT_FILES`, a safetensors file with a readable header, an index whose shards
    are there."""
    folder = os.fspath(folder)
    found = sorted(os.listdir(folder))
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        listing = f"it holds {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}" if found else "it is empty"
        raise ValueError(f"{what} {folder!r} is no draft checkpoint: no config.json ({listing}).")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {folder!r}: {config_path!r} is not valid JSON ({err}).") from err
    if not isinstance(config, dict):
        raise ValueError(f"{what} {folder!r}: its config.json holds a {type(config).__name__}, not a JSON object.")
    name = next((n for n in WEIGHT_FILES if os.path.isfile(os.path.join(folder, n))), None)
    if name is None:
        raise ValueError(f"{what} {folder!r} holds no weights: expected one of {', '.join(WEIGHT_FILES)}.")
    path = os.path.join(folder, name)
    if name.endswith(".index.json"):
        _check_index(path, what)
    elif name.endswith(".safetensors"):
        _check_safetensors_header(path, what)
    elif os.path.getsize(path) == 0:
        raise ValueError(f"{what}: {path!r} is empty.")


def _check_index(path: str, what: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{what}: {path!r} is not a weights index (a JSON object with a weight_map).") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{what}: {path!r} has no weight_map.")
    folder = os.path.dirname(path)
    missing = sorted({shard for shard in weight_map.values() if not os.path.isfile(os.path.join(folder, shard))})
    if missing:
        raise ValueError(f"{what}: {path!r} lists shards that are not there: {', '.join(missing)}.")
    for shard in sorted(set(weight_map.values())):
        if shard.endswith(".safetensors"):
            _check_safetensors_header(os.path.join(folder, shard), what)


def _check_safetensors_header(path: str, what: str) -> None:
    """A safetensors file starts with the length of its JSON header (8 bytes, little-endian), then the header; the
    tensors' bytes follow, as far as the header's last offset."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        header = f.read(length) if length is not None and 8 + length <= size else None
    try:
        tensors = json.loads(header)
        end = max((info["data_offsets"][1] for key, info in tensors.items() if key != "__metadata__"), default=0)
    except (TypeError, json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, IndexError):
        end = None  # no header (None), or one that is not safetensors' table of tensors
    if end is None or 8 + length + end > size:
        raise ValueError(f"{what}: {path!r} is not a safetensors file, or it is truncated or corrupt.")
