"""Where the GPU idles in a profiled step: gaps between device work in a torch.profiler trace.

    python benchmarks/train/trace_gaps.py runs/<case>/profile/trace_rank0.json.gz [--min-us 20]

The device is busy while any kernel, copy or memset runs on any stream (their union); every gap
in that union longer than ``--min-us`` is idle time. A gap is *host-bound* when the work after it
was launched after the gap began (the device had run dry and waited for the host to launch);
otherwise the work was queued in time and waited on something else (another stream's event, a
host-to-device copy from pageable memory). Each host-bound gap is charged to what the launching
thread was doing at the launch: the innermost operator (``cpu_op``) and the innermost Python
frame from model, trainer or kernel code (``lmms_*``, ``transformers``, ``flash_attn``,
``liger_kernel``), so the table says which code leaves the device waiting.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
OWN_CODE = ("lmms_", "transformers/", "flash_attn", "liger_kernel", "quack")


def load(path: str | Path) -> list[dict[str, Any]]:
    """The trace's complete ("X") events."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


class _Enclosing:
    """Events of one thread (they nest), queried for those spanning a time, innermost first.

    The events spanning ``t`` are the last one to start at or before ``t`` and its ancestors that
    have not ended by ``t``: a walk up the nesting, not a scan of the thread.
    """

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.events]
        self.parent: list[int] = []
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and self._end(stack[-1]) < e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def _end(self, i: int) -> float:
        return self.events[i]["ts"] + self.events[i]["dur"]

    def at(self, t: float) -> list[dict[str, Any]]:
        out, i = [], bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            if self._end(i) >= t:
                out.append(self.events[i])
            i = self.parent[i]
        return out


def _frame_label(name: str) -> str:
    """'…/lmms_models/qwen2_5_vl.py(123): forward' -> 'lmms_models/qwen2_5_vl.py:forward'."""
    head, _, func = name.partition(": ")
    path = head.split("(")[0]
    for key in OWN_CODE:
        k = path.find(key)
        if k >= 0:
            path = path[k:]
            break
    return f"{path}:{func}"


def analyze(events: list[dict[str, Any]], min_us: float = 20.0) -> dict[str, Any]:
    """Busy and idle device time over the trace, host-bound gaps charged to the launching code."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not device:
        return {"device_events": 0}
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    by_thread: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    threads = {k: _Enclosing(v) for k, v in by_thread.items()}

    start, end = device[0]["ts"], device[0]["ts"] + device[0]["dur"]
    busy, first = 0.0, start
    gaps: list[tuple[float, float, dict[str, Any]]] = []  # (gap start, length, work after it)
    for e in device[1:]:
        if e["ts"] > end:
            busy += end - start
            if e["ts"] - end >= min_us:
                gaps.append((end, e["ts"] - end, e))
            start, end = e["ts"], e["ts"] + e["dur"]
        else:
            end = max(end, e["ts"] + e["dur"])
    busy += end - start
    span = end - first

    host_bound = 0.0
    by_op: dict[str, float] = defaultdict(float)
    by_frame: dict[str, float] = defaultdict(float)
    waited = 0.0
    for gap_start, length, after in gaps:
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is None or launch["ts"] <= gap_start:
            waited += length
            continue
        host_bound += length
        spans = threads.get((launch.get("pid"), launch.get("tid")))
        stack = spans.at(launch["ts"]) if spans else []
        op = next((e["name"] for e in stack if e.get("cat") == "cpu_op"), "?")
        frame = next(
            (
                _frame_label(e["name"])
                for e in stack
                if e.get("cat") == "python_function" and any(k in e["name"] for k in OWN_CODE)
            ),
            "(no own frame: autograd thread or C++)",
        )
        by_op[op] += length
        by_frame[frame] += length
    idle = span - busy
    small = idle - sum(g[1] for g in gaps)
    return {
        "device_events": len(device),
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": idle / 1e3,
        "gaps": len(gaps),
        "small_gaps_ms": small / 1e3,  # gaps shorter than min_us, summed
        "host_bound_ms": host_bound / 1e3,
        "queued_ms": waited / 1e3,  # work was launched in time but started late
        "by_op_ms": _top(by_op),
        "by_frame_ms": _top(by_frame),
    }


def _top(d: dict[str, float], n: int = 25) -> list[tuple[str, float]]:
    return [(k, round(v / 1e3, 2)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]


def format_report(r: dict[str, Any], min_us: float = 20.0) -> str:
    if not r.get("device_events"):
        return "trace_gaps: no device events in this trace (CPU run?)\n"
    lines = [
        f"device span {r['span_ms']:.1f} ms: busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms "
        f"({r['gaps']} gaps >= {min_us:g} us; {r['small_gaps_ms']:.1f} ms in shorter ones)",
        f"host-bound (launched after the device ran dry): {r['host_bound_ms']:.1f} ms; "
        f"queued in time but started late: {r['queued_ms']:.1f} ms",
        "host-bound idle by the launching operator (ms):",
        *(f"  {v:8.2f}  {k}" for k, v in r["by_op_ms"]),
        "host-bound idle by the innermost own Python frame (ms):",
        *(f"  {v:8.2f}  {k}" for k, v in r["by_frame_ms"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a torch.profiler Chrome trace (.json or .json.gz)")
    ap.add_argument("--min-us", type=float, default=20.0, help="shortest gap listed (us)")
    args = ap.parse_args()
    print(format_report(analyze(load(args.trace), args.min_us), args.min_us), end="")


if __name__ == "__main__":
    main()
