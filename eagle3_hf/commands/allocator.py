"""Keep freed memory in the process's heap during training, so that the next step reuses it (glibc only).

A training step allocates and frees the same large activation and gradient blocks (a few MiB to tens of MiB) every
micro-batch. glibc's defaults hand blocks above a dynamic threshold to ``mmap`` and return freed heap tops to the
system, so each step pays page faults to have the kernel zero fresh pages again: measured on the shipped recipe
(one thread), 7-8% of a step (docs/research/training-cost.md). Raising the mmap threshold to glibc's maximum (32 MiB)
and never trimming keeps those blocks in the heap. This changes the whole process's allocator, so only the training
command calls it (never the library); other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top is kept, in effect all of it


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds as above; True if this process's C library took both."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (no mallopt), or no loadable C library
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
