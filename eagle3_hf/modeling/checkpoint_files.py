"""Reading a draft checkpoint's files: its folder (local, or a Hub snapshot), ``config.json`` and weights (one
safetensors or ``.bin`` file, or a sharded index), with the layout detected and the weights under our key names.

A truncated or corrupt file is named in a `ValueError`. Loading a draft from what is read here is
`eagle3_hf.modeling.checkpoints`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from eagle3_hf.modeling.checkpoint_check import WEIGHT_FILES
from eagle3_hf.modeling.layouts import CONFIG_NAME, detect_layout, normalize_key
from eagle3_hf.modeling.shipped import shipped_draft_folder, unknown_draft_hint
from eagle3_hf.utils.hub import hub_kwargs_for, is_hub_id

__all__ = [
    "CORPUS_FILE",
    "HUB_KWARGS",
    "WEIGHT_FILES",
    "corpus_file",
    "open_safetensors",
    "read_checkpoint",
    "read_weights",
]

HUB_KWARGS = ("revision", "cache_dir", "token", "force_download", "local_files_only", "subfolder", "proxies")
# A draft's corpus of its target's earlier answers, saved beside it (eagle3_hf.generation.corpus_index); never weights.
CORPUS_FILE = "corpus.safetensors"


def _resolve_folder(path_or_id: str | os.PathLike, hub_kwargs: dict[str, Any]) -> str:
    """A local folder holding the checkpoint: `path_or_id` itself, a shipped draft's, or a Hub snapshot of it."""
    path = os.fspath(path_or_id)
    subfolder = hub_kwargs.pop("subfolder", None) or ""
    if os.path.isdir(path):  # a folder of that name wins over a shipped draft, as a local folder wins over the Hub
        return os.path.join(path, subfolder)
    if os.path.exists(path):
        raise ValueError(f"Expected a checkpoint folder or a Hub repo id, got the file {path!r}.")
    shipped = shipped_draft_folder(path)
    if shipped is not None:
        return os.path.join(shipped, subfolder)
    if not is_hub_id(path):  # not worth a request: say what it is not, at once
        raise ValueError(
            f"{path!r}: no such folder, draft shipped with eagle3_hf ({unknown_draft_hint(path)}) or Hub id 'org/name'."
        )
    if not hub_kwargs.get("local_files_only"):  # offline: the cache at once, not a minute of retries
        hub_kwargs = {**hub_kwargs, **hub_kwargs_for(path, "the draft")}
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = [os.path.join(subfolder, p) if subfolder else p for p in ("*.json", "*.safetensors", "*.bin")]
    try:
        root = snapshot_download(repo_id=path, allow_patterns=patterns, **hub_kwargs)
    except (OSError, HFValidationError) as err:
        raise ValueError(
            f"{path!r} is neither a local checkpoint folder, a draft shipped with eagle3_hf "
            f"({unknown_draft_hint(path)}), nor a Hub repo that could be fetched: {err}"
        ) from err
    return os.path.join(root, subfolder)


def corpus_file(path_or_id: str | os.PathLike, hub_kwargs: dict[str, Any]) -> str | None:
    """The path of the `CORPUS_FILE` in a checkpoint's folder (a Hub checkpoint's: the snapshot that loading it just
    fetched, `*.safetensors` included), or None when it has none."""
    try:
        folder = _resolve_folder(path_or_id, dict(hub_kwargs, local_files_only=True))
    except ValueError:  # not in the local Hub cache: nothing was fetched with the weights
        return None
    path = os.path.join(folder, CORPUS_FILE)
    return path if os.path.isfile(path) else None


@contextlib.contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    """`safetensors.safe_open(path, "pt")`; a file that is not one (truncated, corrupt, random bytes) is named in a
    `ValueError` rather than a `SafetensorError` that names no file."""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"Could not read {path!r}: it is not a safetensors file, or it is truncated or corrupt ({err})."
        ) from err
    with handle as f:
        yield f


def _read_file(path: str) -> dict[str, torch.Tensor]:
    try:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        return torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise ValueError(f"Could not read the weights file {path!r}; it is truncated or corrupt: {err}") from err


def read_weights(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (single file or sharded index), with their stored names."""
    name = next((n for n in WEIGHT_FILES if os.path.isfile(os.path.join(folder, n))), None)
    if name is None:
        found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        raise ValueError(f"No weights in {folder!r}: expected one of {list(WEIGHT_FILES)}, found {found}.")
    path = os.path.join(folder, name)
    if not name.endswith(".index.json"):
        return _read_file(path)
    with open(path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map") or {}
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise ValueError(f"{path!r} lists the shard {shard!r}, which is not in {folder!r}.")
        content = _read_file(shard_path)
        tensors.update({k: v for k, v in content.items() if weight_map.get(k) == shard})
    return tensors


def read_checkpoint(
    path_or_id: str | os.PathLike, **hub_kwargs: Any
) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """``(layout, config.json dict, state dict under our key names)`` of a draft checkpoint, files only."""
    folder = _resolve_folder(path_or_id, dict(hub_kwargs))
    config_path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(f"No {CONFIG_NAME} in the checkpoint folder {folder!r}.")
    with open(config_path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_path!r} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_path!r} must hold a JSON object, got {type(config).__name__}.")
    raw = read_weights(folder)
    layout = detect_layout(config, raw.keys())
    state_dict: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = normalize_key(key)
        if name in state_dict:
            raise ValueError(f"{os.fspath(path_or_id)!r} holds two weights that both map to {name!r}.")
        state_dict[name] = tensor
    return layout, config, state_dict
