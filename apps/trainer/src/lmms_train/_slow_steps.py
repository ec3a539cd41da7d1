"""One line on stderr for a step far slower than the steps before it, with what its host did.

A one-off stall (a kernel compiled on first use, a recompile, a full garbage collection) hides in
a long run's mean; the line names the step and, from the step's own metrics, the likely cause:
new dynamo graphs (`compile/graphs`), new FA4 kernels (`compile/fa4_variants`) or seconds in
Python's collector (`perf/gc_s`). For new FA4 kernels it also names what changed in FA4's compile
key against the closest kernel it already held (`note_fa4`), i.e. which size-picked setting the
step's sizes switched.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

import lmms_kernels

_COUNTERS = (("compile/graphs", "dynamo graph(s)"), ("compile/fa4_variants", "FA4 kernel(s)"))


class SlowSteps:
    """``check(step, metrics)``: a message when ``step_time`` exceeds ``factor`` x the median of
    the last ``window`` ordinary steps (after ``warmup`` of them), else None. Slow steps stay
    out of the median, so one stall does not hide the next."""

    def __init__(self, *, factor: float = 3.0, window: int = 20, warmup: int = 3) -> None:
        self.factor, self.warmup = factor, warmup
        self._times: deque[float] = deque(maxlen=window)
        self._counters: dict[str, float] = {}
        self._fa4_count: int | None = None
        self._fa4_keys: dict[str, frozenset] | None = None
        self._fa4_new: dict[int, list[str]] = {}  # step -> its new FA4 kernels, described

    def note_fa4(self, step: int, count: int) -> None:
        """Call with each step's ``compile/fa4_variants``: when it rises, snapshot FA4's compile
        keys and keep the description of the new ones for that step's :meth:`check`."""
        if count == self._fa4_count:
            return
        keys = lmms_kernels.fa4_kernel_keys()
        if self._fa4_keys is not None and keys is not None:
            self._fa4_new[step] = lmms_kernels.describe_new_fa4_kernels(self._fa4_keys, keys)
        self._fa4_keys, self._fa4_count = keys, count

    def check(self, step: int, metrics: Mapping[str, Any]) -> str | None:
        t = float(metrics["step_time"])
        new_fa4 = self._fa4_new.pop(step, [])
        for old in [s for s in self._fa4_new if s < step]:
            del self._fa4_new[old]
        causes = []
        for key, what in _COUNTERS:
            now, before = metrics.get(key), self._counters.get(key)
            if now is not None:
                if before is not None and now > before:
                    causes.append(f"{int(now - before)} new {what}")
                self._counters[key] = now
        median = statistics.median(self._times) if len(self._times) >= self.warmup else None
        if median is None or t <= self.factor * median:
            self._times.append(t)
            return None
        gc_s = float(metrics.get("perf/gc_s", 0.0))
        if gc_s >= 0.1 * t:
            causes.append(f"{gc_s:.2f} s in Python's garbage collector")
        cause = "; ".join(causes) or "no new graphs or FA4 kernels, little garbage collection"
        if new_fa4:
            cause += " (FA4 " + "; ".join(new_fa4) + ")"
        return (
            f"step {step} took {t:.2f} s, {t / median:.1f}x the median of the last "
            f"{len(self._times)} ({median:.2f} s): {cause}"
        )
