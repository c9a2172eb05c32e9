"""Which precision speculative decoding should run in on this machine, and how many threads it gets.

Verifying a tree is only cheap when a forward over n tokens costs about what one token costs. On CPUs with native
bf16 matmul units (Intel AMX, AVX-512 BF16) that holds much better in bf16 than in fp32, where a small-batch matmul
grows with every extra row; without those units bf16 is emulated and slower than fp32. So the default is bf16
where the hardware has it and fp32 elsewhere; every command lets the user override it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's --help must not pay for it
    import torch

__all__ = [
    "DTYPE_CHOICES",
    "NATIVE_BF16_FLAGS",
    "cpu_flags",
    "cpu_name",
    "default_threads",
    "emulated_bf16_warning",
    "has_native_bf16_matmul",
    "resolve_dtype",
    "short_name",
]

# CPU feature flags (Linux /proc/cpuinfo names) that give native bf16 matmul.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def _cpuinfo_value(keys: tuple[str, ...], cpuinfo_path: str = "/proc/cpuinfo") -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of `keys` (None where there is none, e.g. macOS)."""
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(keys):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as the kernel lists them (empty where there is no /proc/cpuinfo, e.g. macOS)."""
    return set((_cpuinfo_value(("flags", "Features"), cpuinfo_path) or "").split())


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), for messages that name the hardware."""
    import platform

    return _cpuinfo_value(("model name",)) or platform.processor() or platform.machine()


def has_native_bf16_matmul(flags: set[str] | None = None) -> bool:
    """Whether CPU matmuls in bf16 run on bf16 hardware: a flag from `NATIVE_BF16_FLAGS` and torch built with
    oneDNN (which is what dispatches bf16 matmuls to those units)."""
    import torch

    flags = cpu_flags() if flags is None else flags
    return torch.backends.mkldnn.is_available() and any(f in flags for f in NATIVE_BF16_FLAGS)


def resolve_dtype(name: str, device: str | torch.device = "cpu", flags: set[str] | None = None) -> torch.dtype:
    """The dtype for `name` ("auto", "float32", "bfloat16", "float16") on `device`.

    "auto": bf16 on a CUDA GPU that supports it and on a CPU with native bf16 matmul (`has_native_bf16_matmul`),
    fp32 everywhere else. `flags` overrides the CPU's own feature flags (for tests, or to ask about another CPU).
    """
    import torch

    if name not in DTYPE_CHOICES:
        raise ValueError(f"Unknown dtype {name!r}; expected one of {', '.join(DTYPE_CHOICES)}.")
    if name != "auto":
        return getattr(torch, name)
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if kind == "cpu":
        return torch.bfloat16 if has_native_bf16_matmul(flags) else torch.float32
    return torch.float32


def emulated_bf16_warning(dtype: str, device: str = "cpu", flags: set[str] | None = None) -> str | None:
    """What to tell a user who asks for bf16 (`dtype` as a command spells it) on a CPU without native bf16 matmul,
    where every matmul is emulated: None where the request is fine. On an AVX2-only CPU (AMD EPYC, 2 cores, one thread
    each) a SmolLM2 training step took 40 s in fp32 and had not finished in 10 minutes in bf16; batched answers took
    6.2 s each in fp32 and over 15 s in bf16."""
    import torch

    if dtype != "bfloat16" or torch.device(device).type != "cpu" or has_native_bf16_matmul(flags):
        return None
    return (
        f"--dtype bfloat16 on a CPU without native bf16 matmul (none of {', '.join(NATIVE_BF16_FLAGS)}): every matmul "
        "is emulated and runs many times slower than in float32; pass --dtype float32 on this machine."
    )


def short_name(dtype: torch.dtype) -> str:
    """ "fp32", "bf16" or "fp16": how configuration names spell a dtype."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise ValueError(f"Expected float32, bfloat16 or float16; got {dtype}.")
    return names[dtype]


def default_threads() -> int:
    """All the cores this process may run on (its CPU affinity where the OS reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
