"""`trainer_args.profile_steps: [first, last]`: torch.profiler over those steps, and where the host
waited for the device.

The profiler runs from the start of step `first` to the start of step `last + 1` (or the end of
training), so the window holds everything the loop does per step in the steady state: fetching
the packs, the forward and backward, the optimizer, and reading the previous step's metrics.
Main rank by default; every rank writes its own files (`rank{r}` in the names):

- `profile/trace_rank{r}.json.gz`: the Chrome/Perfetto trace (open in ui.perfetto.dev);
- `profile/ops_rank{r}.txt`: operators by self device time (CUDA) or self CPU time;
- `profile/syncs_rank{r}.json`: the host's waits for the device, by kind and call site.

Waits counted (CUDA runtime calls; on CPU-only runs there are none):

- `sync`: `cudaStreamSynchronize`, `cudaDeviceSynchronize`, blocking `cudaMemcpy`: the host
  stopped until the device's queue drained (`.item()`, `.tolist()`, `int()`/`bool()` of a device
  tensor, a data-dependent output size, a copy to pageable memory);
- `event_wait`: `cudaEventSynchronize`. The loop waits on one event per step by design: the
  previous step's metrics, copied to pinned memory one step earlier; its time shows whether
  that copy had finished (near zero) or the host really waited.

Each wait's site is the aten op it ran under (e.g. `aten::_local_scalar_dense` for `.item()`)
and the innermost Python frames of the call (`with_stack`), so it points at the line that caused
it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepProfiler", "format_summary", "summarize_waits"]

WAIT_KINDS = {
    "cudaStreamSynchronize": "sync",
    "cudaDeviceSynchronize": "sync",
    "cudaMemcpy": "sync",
    "cudaEventSynchronize": "event_wait",
}
_SITE_FRAMES = 4  # innermost frames kept per call site


def _site(stack: list[str]) -> list[str]:
    """The innermost frames outside torch's own Python (where the user's code called in)."""
    frames = [f for f in stack if not f.startswith("torch/") and "/torch/" not in f]
    return frames[:_SITE_FRAMES]


_PY_FRAME = re.compile(r"^\S+\.py\(\d+\): ")  # how the profiler names a Python function event


def _op(ev: Any) -> str:
    """The nearest aten op at or above `ev` ("" if none)."""
    while ev is not None:
        if ev.name.startswith("aten::"):
            return ev.name
        ev = ev.cpu_parent
    return ""


def _stack(ev: Any) -> list[str]:
    """The Python frames above `ev`, innermost first. Depending on the torch version the profiler
    attaches them to an op (`stack`) or records each Python call as an ancestor event named
    `file.py(line): function`; nested aten ops and CUDA calls have neither, so walk up."""
    frames: list[str] = []
    while ev is not None:
        if ev.stack:
            return frames + list(ev.stack)
        if _PY_FRAME.match(ev.name):
            frames.append(ev.name)
        ev = ev.cpu_parent
    return frames


def summarize_waits(events: Any, kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """Counts and host time (ms) of the waits in profiler `events`, by kind and by call site.
    `kinds`: event name -> kind (default `WAIT_KINDS`)."""
    kinds = WAIT_KINDS if kinds is None else kinds
    totals: dict[str, dict[str, float]] = {
        kind: {"count": 0, "ms": 0.0} for kind in sorted(set(kinds.values()))
    }
    sites: dict[tuple, dict[str, Any]] = {}
    for ev in events:
        kind = kinds.get(ev.name)
        if kind is None:
            continue
        ms = ev.cpu_time_total / 1e3
        totals[kind]["count"] += 1
        totals[kind]["ms"] += ms
        op = _op(ev.cpu_parent)
        site = tuple(_site(_stack(ev)))
        entry = sites.setdefault(
            (ev.name, op, site),
            {"name": ev.name, "kind": kind, "op": op, "count": 0, "ms": 0.0, "site": site},
        )
        entry["count"] += 1
        entry["ms"] += ms
    ranked = sorted(sites.values(), key=lambda e: (-e["count"], -e["ms"]))
    for e in ranked:
        e["ms"] = round(e["ms"], 3)
        e["site"] = list(e["site"])
    for t in totals.values():
        t["ms"] = round(t["ms"], 3)
    return {"totals": totals, "sites": ranked}


class StepProfiler:
    """Starts torch.profiler before step `first`, stops it before step `last + 1` (or at `close`),
    then writes the trace, the operator table and the wait summary under `out_dir/profile`."""

    def __init__(
        self,
        steps: list[int],
        out_dir: Path,
        device: torch.device,
        rank: int,
        *,
        announce: bool = False,
    ) -> None:
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir = Path(out_dir) / "profile"
        self.device, self.rank, self.announce = device, rank, announce
        self.summary: dict[str, Any] | None = None
        self._prof: Any = None

    @property
    def enabled(self) -> bool:
        return self.first >= 1

    def before_step(self, step: int) -> None:
        """Call at the top of the loop with the number of the step about to run (1-based)."""
        if not self.enabled:
            return
        if step == self.first and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts, record_shapes=False, with_stack=True)
            self._prof.__enter__()
        elif step == self.last + 1:
            self.close()

    def close(self) -> None:
        """Stop (if running) and write the files; the summary stays in `self.summary`."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels, all in the trace
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        tag = f"rank{self.rank}"
        prof.export_chrome_trace(str(self.dir / f"trace_{tag}.json.gz"))
        cuda = self.device.type == "cuda"
        table = prof.key_averages().table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=60
        )
        (self.dir / f"ops_{tag}.txt").write_text(table)
        summary = summarize_waits(prof.events())
        summary["steps"] = [self.first, self.last]
        (self.dir / f"syncs_{tag}.json").write_text(json.dumps(summary, indent=1))
        self.summary = summary
        if self.announce:
            print(f"[lmms-train] {format_summary(summary)}", file=sys.stderr, flush=True)


def format_summary(summary: dict[str, Any]) -> str:
    """One line for the console: waits per kind over the profiled steps."""
    t = summary["totals"]
    parts = [f"{k} {int(v['count'])} ({v['ms']:.1f} ms)" for k, v in t.items()]
    first, last = summary["steps"]
    return f"profile of steps {first}-{last}: host waits: " + ", ".join(parts)
