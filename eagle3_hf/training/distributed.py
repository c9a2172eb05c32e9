"""Distributed training and feature extraction: FSDP2 for the frozen target, rank splitting, the per-process memory.

Under FSDP2 (`torch.distributed.fsdp.fully_shard`) a module's parameters are all-gathered by hooks that run when the
module is *called*; under DDP gradients are reduced for the work of the wrapped module's forward. Training calls the
draft's own forward once per TTT step (through DDP when it wraps the draft), which calls each decoder layer and the
head: the hooks fire around each, with nothing patched.

The frozen target (online features) is not seen by the `Trainer`'s accelerate wrapping: `shard_frozen_target` shards
it layer by layer with FSDP2 over the same processes, for forward passes only (each rank keeps ``1/world_size`` of
every weight and gathers one layer at a time); `fsdp_memory_per_process` is the per-process memory that leaves.
Feature extraction splits its shards by rank (`distributed_rank`, `barrier`); the `check_*`/`refuse_*` functions
turn the set-ups that are not supported into errors that name the setting to change.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "barrier",
    "check_device_map",
    "check_fsdp_loading",
    "check_fsdp_plugin",
    "distributed_rank",
    "enable_cpu_fsdp",
    "end_distributed",
    "fsdp_mesh",
    "fsdp_memory_per_process",
    "init_distributed_from_launcher",
    "is_fsdp2_module",
    "parameter_bytes",
    "process_device",
    "refuse_deepspeed",
    "reshard",
    "shard_frozen_target",
]


def is_fsdp2_module(module: nn.Module) -> bool:
    """True when `module` was sharded with `torch.distributed.fsdp.fully_shard` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def parameter_bytes(module: nn.Module) -> tuple[int, int]:
    """``(bytes held by this process, bytes of the whole unsharded parameters)`` of `module`'s parameters.

    For FSDP2-sharded parameters (DTensors) the first counts only the local shard; shared parameters count once.
    """
    local = full = 0
    seen: set[int] = set()
    for param in module.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.element_size()
        full += param.numel() * size
        to_local = getattr(param, "to_local", None)
        local += (to_local().numel() if to_local is not None else param.numel()) * size
    return local, full


def fsdp_memory_per_process(target: nn.Module | None, draft: nn.Module, world_size: int) -> dict[str, int]:
    """Bytes each of `world_size` FSDP2 processes holds for the lasting training state, from the models' sizes.

    ``target``: the target's weights / W (in their dtype); ``draft``: the draft's fp32 weights / W (its frozen
    embedding included); ``gradients`` and ``optimizer``: 4 and 8 (AdamW's two moments) bytes per trainable draft
    weight / W; ``total``: their sum. ``gathered``: what is held whole on top for a moment, the larger of the
    target's largest unit (a decoder layer, the embedding or the head, as `shard_frozen_target` makes them) and the
    draft's gathered units (root and head, plus the largest of its embedding and layers). Activations are not
    included.
    The models may be whole, sharded, or on the meta device (sizes only).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    target_bytes = parameter_bytes(target)[1] if target is not None else 0
    params = {id(p): p for p in draft.parameters()}.values()
    draft_weights = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    # The draft's units as accelerate makes them: the head and the root stay gathered from forward to backward,
    # the embedding and each decoder layer (`_no_split_modules`: midlayer and every upper layer) around each use.
    base = draft.get_base_model() if hasattr(draft, "get_base_model") else draft
    units = {"embed_tokens": base.embed_tokens, "lm_head": base.lm_head}
    units.update({f"layer {i}": layer for i, layer in enumerate(base.draft_layers())})
    unit_bytes = {name: parameter_bytes(module)[1] for name, module in units.items()}
    draft_rest = parameter_bytes(draft)[1] - sum(unit_bytes.values())
    one_at_a_time = max(b for name, b in unit_bytes.items() if name != "lm_head")
    gathered = draft_rest + unit_bytes["lm_head"] + one_at_a_time
    if target is not None:
        sizes = [sum(parameter_bytes(m)[1] for m in unit) for unit in _target_units(target)]
        gathered = max([gathered, *sizes, target_bytes - sum(sizes)])  # the root holds what no unit does
    out = {
        "target": target_bytes // world_size,
        "draft": 4 * draft_weights // world_size,
        "gradients": 4 * trainable // world_size,
        "optimizer": 8 * trainable // world_size,
    }
    out["total"] = sum(out.values())
    out["gathered"] = gathered
    return out


def _target_units(target: nn.Module, layer_cls_names: list[str] | None = None) -> list[list[nn.Module]]:
    """The FSDP units of a causal LM: each decoder layer, the input embedding, the output head (one unit with the
    embedding when they share their weight)."""
    base = target.get_base_model() if hasattr(target, "get_base_model") else target  # a PEFT-wrapped target
    names = set(layer_cls_names if layer_cls_names is not None else getattr(base, "_no_split_modules", None) or [])
    # By class name along the MRO: FSDP2 turns a sharded LlamaDecoderLayer into an FSDPLlamaDecoderLayer subclass.
    units = [[m] for m in target.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not units:
        raise ValueError(
            f"Found no decoder layer to shard in {type(target).__name__}: looked for classes {sorted(names)} "
            "(its _no_split_modules); pass layer_cls_names=[...]."
        )
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    if embed is not None and head is not None and head.weight is embed.weight:
        units.append([embed, head])  # tied: one weight, one unit
    else:
        units += [[m] for m in (embed, head) if m is not None]
    return units


def shard_frozen_target(target: nn.Module, mesh: Any = None, layer_cls_names: list[str] | None = None) -> nn.Module:
    """Shard a frozen target with FSDP2 for forward passes: each decoder layer, the embedding and the output head are
    units of their own, the rest (final norm) the root's.

    Each process keeps ``1/world_size`` of every parameter (dim 0 split); a forward gathers one unit at a time and
    frees it after use (``reshard_after_forward=True`` everywhere, the root included: nothing runs backward through
    the target). The target is set to eval mode and ``requires_grad=False``; its parameters move to the mesh's
    device (the current accelerator, or the CPU with the gloo backend).

    Args:
        target: the causal LM (optionally PEFT-wrapped); already sharded targets are returned as they are.
        mesh: a 1-D `DeviceMesh`; `None` shards over the default process group.
        layer_cls_names: the decoder layer class names to shard one by one; default the model's
            ``_no_split_modules``.

    Raises `ValueError` when torch.distributed is not initialised or no decoder layer class is found.
    """
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_frozen_target needs an initialised torch.distributed process group (torchrun).")
    if is_fsdp2_module(target):
        return target
    units = _target_units(target, layer_cls_names)
    target.requires_grad_(False)
    target.eval()
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(target, mesh=mesh, reshard_after_forward=True)
    return target


def enable_cpu_fsdp(accelerator: Any, fsdp_plugin_args: dict | None) -> bool:
    """Switch accelerate's FSDP plugin on for CPU processes (gloo) when FSDP was asked for; True if it did.

    accelerate enables its FSDP plugin for GPUs and other accelerators only: on CPU processes it silently falls back
    to DDP. Its FSDP2 code path (sharding, state dicts, checkpoints) runs on CPU with gloo all the same. FSDP is
    asked for by the arguments (`fsdp_plugin_args`, `TrainingArguments.fsdp_plugin_args`) or by an accelerate
    config (``ACCELERATE_USE_FSDP``, the plugin then reads the launcher's ``FSDP_*`` settings).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    asked = fsdp_plugin_args is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not asked or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**(fsdp_plugin_args or {}))
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    # Both states: every AcceleratorState() re-reads distributed_type from the process's PartialState.
    PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True


def fsdp_mesh(accelerator: Any) -> Any:
    """The device mesh accelerate shards the draft over (`None`: the default process group)."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    return None if mesh is None else mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]


def check_fsdp_loading(cpu_ram_efficient_loading: bool | None = None) -> None:
    """Refuse FSDP's ``cpu_ram_efficient_loading`` (accelerate launch turns it on by default).

    With it, `from_pretrained` gives every process but the first empty weights, to be filled by the model that
    accelerate prepares: the draft's vocabulary buffers and the target (which accelerate never prepares) would
    stay empty. The target is sharded at load time instead (`load_target(..., shard=True)`); the draft is small.
    `None` reads the launcher's ``FSDP_CPU_RAM_EFFICIENT_LOADING``.
    """
    if cpu_ram_efficient_loading is None:
        use_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        flag = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() in ("1", "true", "yes")
        cpu_ram_efficient_loading = use_fsdp and flag
    if cpu_ram_efficient_loading:
        raise ValueError(
            "FSDP cpu_ram_efficient_loading is not supported: it leaves the target and the draft's vocabulary empty "
            "on all processes but the first. Set `fsdp_cpu_ram_efficient_loading: false` in the accelerate config "
            "(or --fsdp_cpu_ram_efficient_loading false); the target is sharded while it loads anyway."
        )


def check_fsdp_plugin(plugin: Any) -> None:
    """Refuse the FSDP settings `Eagle3Trainer` does not support (an accelerate `FullyShardedDataParallelPlugin`)."""
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(
            f"Only FSDP2 is supported, got fsdp_version={version}: set fsdp_config={{'version': 2}} (the "
            "TrainingArguments default) or `fsdp_version: 2` in the accelerate config."
        )
    check_fsdp_loading(bool(plugin.cpu_ram_efficient_loading))
    if plugin.activation_checkpointing:
        raise ValueError(
            "FSDP's activation_checkpointing is not supported (it wraps the draft layers, which the TTT loop calls "
            "once per step each); use gradient_checkpointing=True, which checkpoints each layer's TTT step."
        )


def refuse_deepspeed(requested: bool | None = None) -> None:
    """Refuse DeepSpeed, asked for in the arguments (`requested`) or by the launcher (``ACCELERATE_USE_DEEPSPEED``)."""
    if requested or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise ValueError(
            "DeepSpeed (any ZeRO stage) is not supported: train under DDP, or shard with FSDP2 "
            "(fsdp='full_shard auto_wrap', or an accelerate config with fsdp_version: 2)."
        )


def reshard(module: nn.Module) -> None:
    """Free the gathered weights FSDP2 units keep after a forward (``reshard_after_forward=False``, e.g. the head
    of a target that transformers sharded at load time): a frozen target needs them again only at the next batch."""
    for sub in module.modules():
        if is_fsdp2_module(sub):
            sub.reshard()


def distributed_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process in the initialised torch.distributed group, else ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """Wait for every process of the initialised torch.distributed group (nothing to wait for otherwise)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def init_distributed_from_launcher() -> tuple[int, int]:
    """Join the process group a launcher set up (``torchrun``, ``accelerate launch``: ``WORLD_SIZE > 1``).

    The group is initialised through accelerate (gloo on CPU, NCCL on CUDA, each process on its local device).
    Returns ``(rank, world_size)``; ``(0, 1)`` for a plain single process.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized()):
        from accelerate import PartialState

        PartialState()
    return distributed_rank()


def end_distributed(finished: bool) -> bool:
    """Tear down this process's default process group, if any; True when there was one.

    Left to the interpreter's exit, the group's backend threads (gloo's, NCCL's watchdog) are destroyed while still
    running, and a process that has done all its work can abort ("terminate called without an active exception",
    SIGABRT): the launcher then reports a failed run. When this process `finished` its command, it first waits for
    every other one, so that no process tears its end down while another still writes or saves through the group;
    after a failure it does not wait (the others may never come) and only releases its own end.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        if finished and dist.get_world_size() > 1:
            dist.barrier()
    except RuntimeError as error:  # a peer already gone (it failed): nothing left to wait for
        warnings.warn(f"Another process left before this one finished: {error}", RuntimeWarning, stacklevel=2)
    finally:
        dist.destroy_process_group()
    return True


def process_device(device: str) -> str:
    """`device` for this process: a bare accelerator type (``"cuda"``) becomes the launcher's ``LOCAL_RANK`` one."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and device in ("cuda", "xpu", "npu", "mlu", "hpu"):
        return f"{device}:{local_rank}"
    return device


def check_device_map(device_map: str | None) -> str | None:
    """Refuse ``device_map`` when several processes share a machine's accelerators; return it otherwise.

    Each process would place the whole target over every accelerator of its machine; spreading a target over a
    machine's devices calls for one process per machine (``torchrun --nproc_per_node 1``).
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_map is not None and local_world > 1 and torch.cuda.is_available():
        raise ValueError(
            f"device_map={device_map!r} with {local_world} processes on this machine: each would spread the target "
            "over all of its GPUs. Run one process per machine (torchrun --nproc_per_node 1), or drop device_map."
        )
    return device_map
