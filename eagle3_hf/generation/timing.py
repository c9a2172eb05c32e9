"""Named wall-clock sections of a decoding call, for profiling the cycle (`scripts/research/cycle_profile.py`).

A `CycleTimer` is per-call state like `DecodeRun`: the loop (engine.py) holds it in `DecodeRun` and hands it to
the row-exact attention state, never to a module; the loop times a few coarse sections per cycle (draft, target
forward, acceptance, cache compaction, emit). Without one the steps use `NO_TIMER`, whose methods do
nothing, so an ordinary call pays two no-op method calls per section.

Usage inside a step: `mark = timer.now()` ... `timer.add("name", mark)` adds the seconds since `mark` to section
`name` of the current cycle. Sections may nest (the row-exact attention's sections lie inside "target forward");
a report subtracts nested sections from their parent where it wants the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CycleTimer", "NO_TIMER", "NullTimer"]


class NullTimer:
    """The timer of an unprofiled call: every method is a no-op."""

    enabled = False

    def now(self) -> float:
        return 0.0

    def add(self, name: str, mark: float) -> None:
        return None

    def start_cycle(self, **info: Any) -> None:
        return None

    def note(self, **info: Any) -> None:
        return None


NO_TIMER = NullTimer()


@dataclass
class CycleTimer(NullTimer):
    """Seconds per named section and how often it ran, one record per cycle (`cycles[i]["sections"]`,
    `cycles[i]["counts"]`), plus what the caller noted about the cycle (`cycles[i]["info"]`, e.g. its tree size).
    Sections timed before the first cycle (the prefill's) go to `outside`."""

    enabled = True
    cycles: list[dict[str, Any]] = field(default_factory=list)
    outside: dict[str, Any] = field(default_factory=lambda: {"info": {}, "sections": {}, "counts": {}})

    def now(self) -> float:
        return time.perf_counter()

    def add(self, name: str, mark: float) -> None:
        seconds = time.perf_counter() - mark
        cycle = self.cycles[-1] if self.cycles else self.outside
        cycle["sections"][name] = cycle["sections"].get(name, 0.0) + seconds
        cycle["counts"][name] = cycle["counts"].get(name, 0) + 1

    def start_cycle(self, **info: Any) -> None:
        self.cycles.append({"info": dict(info), "sections": {}, "counts": {}})

    def note(self, **info: Any) -> None:
        """Add to the current cycle's info (what is known only after the cycle started, e.g. its tree size)."""
        if self.cycles:
            self.cycles[-1]["info"].update(info)
