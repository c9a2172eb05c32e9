"""How many of this process's cores other jobs are using now, and so how many threads a timing should take.

torch's threads wait for each other at every operation, so a run that gives one thread to a core another job holds
goes at that core's share of time: measured on a 2-core machine with one core busy, 2 threads decoded SmolLM2 at
1.4-1.7 tokens/s and 1 thread at 17-18. A timing therefore takes only the cores that are free, and none when none
is. Busy time is read from /proc/stat (Linux), over a short sample of the cores this process may run on; elsewhere
from the load average (which lags by up to a minute), and not at all where neither exists (Windows).
"""

from __future__ import annotations

import os
import time

__all__ = ["FREE_SHARE", "busy_cores", "core_loads", "cpu_quota", "freest_cpus", "pick_threads", "usable_cpus"]

# A core counts as free when other jobs used at most this much less than all of it: a quarter of a core busy
# already costs a thread that must wait for it more than the thread gains.
FREE_SHARE = 0.75
SAMPLE_SECONDS = 0.5


def usable_cpus() -> list[int]:
    """The cores this process may run on (its CPU affinity where the OS reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """The cores a container's CPU quota allows (cgroup v2 ``cpu.max``: "QUOTA PERIOD", rounded up), or None where
    there is no quota: a container limited to 2 cores of a 16-core host still lists all 16 in its affinity."""
    try:
        with open(path, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def _cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """``{cpu: (busy, total)}`` jiffies since boot, from /proc/stat's ``cpuN`` lines."""
    times = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                # user nice system idle iowait irq softirq steal (guest time is already counted in user)
                values = [int(v) for v in fields[:8]]
                idle = values[3] + (values[4] if len(values) > 4 else 0)
                times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def core_loads(cpus: list[int], seconds: float = SAMPLE_SECONDS) -> dict[int, float] | None:
    """Each of `cpus`' busy share (0.0 to 1.0) over a sample of `seconds` (this process sleeps through it, so its own
    work is not counted), or None where /proc/stat cannot be read."""
    try:
        before = _cpu_times()
        time.sleep(seconds)
        after = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    loads = {}
    for cpu in cpus:
        if cpu in before and cpu in after:
            total = after[cpu][1] - before[cpu][1]
            loads[cpu] = (after[cpu][0] - before[cpu][0]) / total if total > 0 else 0.0
    return loads


def busy_cores(cpus: list[int], seconds: float = SAMPLE_SECONDS, loads: dict[int, float] | None = None) -> float | None:
    """How many of `cpus` other processes keep busy, in cores (0.0 to len(cpus)): the sum of their `core_loads`
    (sampled here unless given), or the last minute's load average where /proc/stat is missing; None where neither
    can be read."""
    if loads is None:
        loads = core_loads(cpus, seconds)
    if loads is not None:
        return sum(loads.values())
    try:
        return min(float(len(cpus)), os.getloadavg()[0])
    except (AttributeError, OSError):  # no load average on this platform (Windows)
        return None


def freest_cpus(loads: dict[int, float], count: int) -> list[int]:
    """The `count` least busy cores of `loads` (ties by core number): where a timing takes fewer threads than there
    are cores, it is pinned to these, so that the scheduler never moves its threads onto a core another job holds."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}.")
    return sorted(sorted(loads, key=lambda cpu: (loads[cpu], cpu))[:count])


def pick_threads(cores: int, busy: float | None) -> int:
    """Threads for a timing on `cores` cores of which `busy` are in use by other jobs: one per free core (a core
    with at least `FREE_SHARE` of its time free), all `cores` when the load is unknown, and 0 when no core is free
    (a timing then measures the other jobs, not this one)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}.")
    if busy is None:
        return cores
    free = cores - max(0.0, busy)
    return max(0, min(cores, int(free + 1.0 - FREE_SHARE)))
