"""Host time in Python's cyclic garbage collector, per training step.

A full (generation 2) collection walks every tracked object, and a process that has compiled
models holds many (graphs, guards, symbolic shapes), so one collection can stall the host long
enough for the device to drain its queue. The clock makes such a step visible in the metrics
instead of leaving it to guesswork (benchmarks/models/NOTES.md, item 27).
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Seconds spent in collections and the number of full collections since the last `take`."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._seconds = 0.0
        self._full = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None
            self._full += info.get("generation") == 2

    def take(self) -> dict[str, float]:
        out = {"perf/gc_s": self._seconds, "perf/gc_full": float(self._full)}
        self._seconds, self._full = 0.0, 0
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
