"""Python's cyclic garbage collector in the training loop: a clock, and no pauses in steady state.

A full (generation 2) collection walks every tracked object, and a process that has compiled
models holds many (graphs, guards, symbolic shapes), so one collection can stall the host long
enough for the device to drain its queue: 0.55-0.62 s in measured VL runs (benchmarks/RESULTS.md,
seventh session). :class:`GcClock` makes such a step visible in the metrics; :class:`GcControl`
(``trainer_args.gc_control``) removes the automatic ones:

- after the first step (set-up, compilation and the optimizer's lazily built state are done),
  one full collection, then ``gc.freeze()``: every object alive moves to a permanent generation
  that later collections never scan;
- automatic collection off (``gc.disable()``), so no collection of any generation starts at an
  allocation inside a step;
- at each step's safe point (after the step's device work is queued, while the device runs it)
  a collection of the young generations (``gc.collect(1)``: the objects of the last step or so,
  cheap), and a full one (of the unfrozen objects only) at checkpoint and evaluation steps and
  every ``gc_full_collect_steps`` steps, so reference cycles are still reclaimed.

The loop restores the collector (unfreeze, enable) when it ends.
"""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["GcClock", "GcControl"]


class GcClock:
    """Seconds spent in collections and the number of full collections since the last `take`:
    ``perf/gc_full`` counts the automatic ones (those :class:`GcControl` did not start),
    ``perf/gc_controlled`` the ones it started."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._seconds = 0.0
        self._full = 0
        self._controlled = 0
        self.controlling = False  # set by GcControl around its own collections
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None
            if info.get("generation") == 2:
                if self.controlling:
                    self._controlled += 1
                else:
                    self._full += 1

    def take(self) -> dict[str, float]:
        out = {
            "perf/gc_s": self._seconds,
            "perf/gc_full": float(self._full),
            "perf/gc_controlled": float(self._controlled),
        }
        self._seconds, self._full, self._controlled = 0.0, 0, 0
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class GcControl:
    """Freeze after warm-up, no automatic collections, collections at safe points (module doc).

    ``enabled=False`` leaves Python's collector as it is (every method is then a no-op)."""

    def __init__(self, enabled: bool, full_every: int, clock: GcClock | None = None) -> None:
        self.enabled, self.full_every, self.clock = enabled, full_every, clock
        self.frozen = False
        self._was_enabled = gc.isenabled()

    def _collect(self, generation: int) -> None:
        if self.clock is not None:
            self.clock.controlling = True
        try:
            gc.collect(generation)
        finally:
            if self.clock is not None:
                self.clock.controlling = False

    def after_warmup(self) -> None:
        """One full collection, freeze what is alive, switch automatic collection off."""
        if not self.enabled or self.frozen:
            return
        self._collect(2)
        gc.freeze()
        gc.disable()
        self.frozen = True

    def safe_point(self, step: int, *, full: bool = False) -> None:
        """At a step boundary with the step's work queued: young generations, or a full
        collection when ``full`` (a save or eval step) or every ``full_every`` steps."""
        if not self.frozen:
            return
        full = full or bool(self.full_every and step % self.full_every == 0)
        self._collect(2 if full else 1)

    def close(self) -> None:
        """Give Python its collector back (unfreeze, enable as it was)."""
        if self.frozen:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            self.frozen = False
