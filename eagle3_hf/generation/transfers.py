"""Every host<->device transfer of the decoding loop, and its clocks, in one place.

On an accelerator each read of a tensor's value on the host waits for every queued kernel, and so does a copy of a
Python list to the device from ordinary (pageable) host memory. The loop therefore moves data only through here:

- `upload`: Python lists to the device, all of a step's lists in one staged copy (from pinned memory and
  non-blocking on CUDA, so the host does not wait for the device);
- `read`: tensors' values on the host, all of a step's tensors in one copy (one synchronisation);
- `Clock`: the cost model's clocks -- `time.perf_counter` on the CPU, CUDA events on CUDA, read only once a `read`
  has made the device catch up (`Clock.later` defers a measurement until then), so that timing adds no wait.

`COUNT` counts the uploads and reads (tests/test_sync_count.py bounds them per cycle, whatever the rows, tree size and
depth). A read is the one place a synchronisation is meant: under `torch.cuda.set_sync_debug_mode("error")` it is
allowed there and nowhere else.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["COUNT", "Clock", "TransferCount", "read", "upload"]


@dataclass
class TransferCount:
    """Uploads and reads made so far (tests reset and compare it)."""

    uploads: int = 0
    reads: int = 0


COUNT = TransferCount()


@contextlib.contextmanager
def _sync_allowed(device: torch.device) -> Iterator[None]:
    """A synchronisation this module means to make: allowed even under CUDA's sync debug mode."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _flat(values: Sequence) -> tuple[list, tuple[int, ...]]:
    """A 1-D list, or a list of equal-length lists, as one flat list and its shape."""
    if len(values) and isinstance(values[0], (list, tuple)):
        width = len(values[0])
        if any(len(row) != width for row in values):
            raise ValueError(f"upload takes lists of equal-length rows; got row lengths {[len(r) for r in values]}")
        return [x for row in values for x in row], (len(values), width)
    return list(values), (len(values),)


def upload(device: torch.device, *arrays: Sequence, floats: Sequence[int] = ()) -> list[torch.Tensor]:
    """Each of `arrays` (a list of numbers, or a list of equal-length lists) on `device` as an int64 tensor (float32
    for the positions in `floats`), in one copy: on CUDA from pinned memory without waiting."""
    COUNT.uploads += 1
    floats = set(floats)
    if device.type == "cpu":  # nothing to copy: the tensors are made where they are used
        return [
            torch.tensor(values, dtype=torch.float32 if i in floats else torch.long).reshape(_flat(values)[1])
            for i, values in enumerate(arrays)
        ]
    staged, sizes = _stage(arrays, floats)
    if device.type == "cuda":
        staged = staged.pin_memory()
    return _unstage(staged.to(device, non_blocking=device.type == "cuda"), sizes, floats)


def _stage(arrays: Sequence[Sequence], floats: set[int]) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """The arrays packed into one host int64 tensor (float32 values as their bits), and each one's shape."""
    chunks, shapes = [], []
    for i, values in enumerate(arrays):
        flat, shape = _flat(values)
        if i in floats:  # float32 bits carried in the int64 staging buffer, exactly
            chunks.append(torch.tensor(flat, dtype=torch.float32).view(torch.int32).long())
        else:
            chunks.append(torch.tensor(flat, dtype=torch.long))
        shapes.append(shape)
    return (torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)), shapes


def _unstage(staged: torch.Tensor, shapes: list[tuple[int, ...]], floats: set[int]) -> list[torch.Tensor]:
    """`_stage`'s arrays back, as views of `staged` (wherever it is now)."""
    out, start = [], 0
    for i, shape in enumerate(shapes):
        n = 1
        for size in shape:
            n *= size
        part = staged[start : start + n]
        out.append((part.int().view(torch.float32) if i in floats else part).reshape(shape))
        start += n
    return out


def read(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Every tensor's values as a flat list, in one device-to-host copy (float64 holds token ids and fp32 scores
    exactly). No tensors: no read."""
    if not tensors:
        return []
    COUNT.reads += 1
    with _sync_allowed(tensors[0].device):
        values = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(values[start : start + t.numel()])
        start += t.numel()
    return out


@dataclass
class Clock:
    """The cost model's clock on `device`: marks are `perf_counter` seconds on the CPU (and other devices); on CUDA
    a CUDA event recorded in the stream (taking one never waits) with the host's time beside it."""

    device: torch.device
    _pending: list[tuple[Any, Any, Callable[[float], None]]] = field(default_factory=list)

    @property
    def events(self) -> bool:
        return self.device.type == "cuda"

    def mark(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark `start` to mark `end`, never waiting: on CUDA the events' time where the device has
        reached `end` (a `read` came after it), else the host's (a read between the marks made the device catch up
        then, so the host's time covers the device's work)."""
        if not self.events:
            return end - start
        if end[0].query():
            return start[0].elapsed_time(end[0]) / 1000.0
        return end[1] - start[1]

    def later(self, start: Any, end: Any, then: Callable[[float], None]) -> None:
        """Hand `then` the seconds from `start` to `end`: now on the CPU, at the next `settle` on CUDA."""
        if self.events:
            self._pending.append((start, end, then))
        else:
            then(end - start)

    def settle(self) -> None:
        """Deliver the deferred measurements (call it after a `read`: their marks are reached by then)."""
        pending, self._pending = self._pending, []
        for start, end, then in pending:
            then(self.seconds(start, end))
