"""The row-invariance probe's answers on disk, so that a second process on the same machine does not pay for it.

The probe (probe.py) asks whether this CPU's kernels compute a tree verify forward bit for bit as one-token steps.
Its answer is a fact about the kernels that run, not about the weights' values: it is decided by the CPU (model name
and feature flags, which pick the kernels), torch's version and CPU capability, the thread count (which splits the
matmuls), the dtype, the device, the attention implementation, transformers' version (the attention code), the
target's module types (prepacked weights run other kernels) and its layer shapes and configuration (which kernels'
blockings a matmul gets). `probe_key` gathers exactly these; an answer is kept in one small JSON file per key.

Where: `$EAGLE3_HF_PROBE_CACHE` if set ("off", "0" or "none" turns the disk cache off), else `eagle3_hf/probes` in
the user's cache folder: `$XDG_CACHE_HOME`, else `~/.cache` (the folder Hugging Face's own caches live in).
`EAGLE3_HF_REFRESH_PROBE=1` (or `refresh=True`) runs the probe again and replaces the stored answer. Files are
written whole or not at all (utils/atomic.py); an unreadable or corrupt file is ignored with a warning and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import transformers

from eagle3_hf.generation.probe import DEFAULT_PROBE_TREE, ProbeResult
from eagle3_hf.utils.atomic import replace_path, temporary_sibling
from eagle3_hf.utils.precision import cpu_flags, cpu_name

__all__ = ["CACHE_ENV", "REFRESH_ENV", "load_probe", "probe_cache_dir", "probe_key", "refresh_requested", "store_probe"]

CACHE_ENV = "EAGLE3_HF_PROBE_CACHE"
REFRESH_ENV = "EAGLE3_HF_REFRESH_PROBE"
_OFF = ("off", "0", "none", "false", "no")
# Bumped when the probe itself changes what it checks: older answers then no longer match any key.
_PROBE_VERSION = 1


def probe_cache_dir() -> Path | None:
    """The folder the probe's answers live in (module docstring), or None when the disk cache is off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle3_hf" / "probes"


def refresh_requested() -> bool:
    """Whether `$EAGLE3_HF_REFRESH_PROBE` asks for the probe to run again (any value but empty, 0, off, ...)."""
    value = os.environ.get(REFRESH_ENV, "").strip().lower()
    return bool(value) and value not in _OFF


def _config_fingerprint(model: torch.nn.Module) -> str:
    """The target's configuration (names and paths left out: they do not pick kernels) and every parameter's name,
    shape and dtype, hashed."""
    config = model.config.to_dict()
    for name in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash"):
        config.pop(name, None)
    shapes = [(name, list(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    text = json.dumps([config, shapes], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def probe_key(model: torch.nn.Module) -> dict[str, Any]:
    """What decides the probe's answer for `model` in this process's current setting (module docstring)."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "probe_version": _PROBE_VERSION,
        "probe_tree": list(DEFAULT_PROBE_TREE),
        "cpu": cpu_name(),
        "cpu_flags": sorted(cpu_flags()),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cpu_capability": capability,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "attn_implementation": str(getattr(model.config, "_attn_implementation", None)),
        "module_types": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}),
        "model": _config_fingerprint(model),
    }


def _path(folder: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return folder / f"{digest[:32]}.json"


def load_probe(key: dict[str, Any], folder: Path | None = None) -> ProbeResult | None:
    """The stored answer for `key`, or None (none stored, the cache off, or the file unreadable: then a warning)."""
    folder = probe_cache_dir() if folder is None else folder
    if folder is None:
        return None
    path = _path(folder, key)
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored["key"] != key:  # a hash collision, or a file edited by hand
            return None
        result = stored["result"]
        names = {f.name for f in fields(ProbeResult)}
        if set(result) != names:
            raise ValueError(f"fields {sorted(result)}, expected {sorted(names)}")
        return ProbeResult(**result)
    except (OSError, ValueError, TypeError, KeyError) as error:
        warnings.warn(
            f"Ignoring the row-invariance probe's cache file {path} ({type(error).__name__}: {error}); the probe "
            "runs again and replaces it.",
            stacklevel=3,
        )
        return None


def store_probe(key: dict[str, Any], result: ProbeResult, folder: Path | None = None) -> Path | None:
    """Keep `result` for `key` (atomically); returns the file, or None when the cache is off or cannot be written
    (a read-only home, say: a warning, never an error -- the cache only saves time)."""
    folder = probe_cache_dir() if folder is None else folder
    if folder is None:
        return None
    path, temporary = _path(folder, key), None
    try:
        temporary = temporary_sibling(path, directory=False)
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({"key": key, "result": asdict(result)}, f, indent=1, sort_keys=True)
        replace_path(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
        warnings.warn(f"Could not keep the row-invariance probe's answer in {folder}: {error}", stacklevel=3)
        return None
    return path
