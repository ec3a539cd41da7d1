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
and the innermost Python frames the profiler attached to it (`with_stack`). On the GPU the
profiler often attaches none (torch 2.11 on the H200 gave empty sites), so on CUDA the window
also runs under CUDA's sync debug mode ("warn"): every synchronising call torch knows of
(`.item()`, `.tolist()`, `bool()` of a device tensor, `nonzero`, blocking copies, ...) reports
the Python stack that made it, collected in the summary's `debug_sites` (innermost frames
first, torch's own frames dropped). A sync inside backward reports the `backward()` call,
marked `[backward]`.
The profiler's own synchronisation when the window closes is not counted.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepProfiler", "SyncLog", "format_summary", "summarize_waits"]

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


_CLOSE_MARK = "lmms::profile_close"  # the window's end: waits from here on are the profiler's


def summarize_waits(events: Any, kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """Counts and host time (ms) of the waits in profiler `events`, by kind and by call site.
    `kinds`: event name -> kind (default `WAIT_KINDS`). Waits that start at or after a
    `lmms::profile_close` range (the profiler's own closing synchronisation) are left out."""
    kinds = WAIT_KINDS if kinds is None else kinds
    events = list(events)
    marks = [ev.time_range.start for ev in events if ev.name == _CLOSE_MARK]
    end = min(marks) if marks else None
    totals: dict[str, dict[str, float]] = {
        kind: {"count": 0, "ms": 0.0} for kind in sorted(set(kinds.values()))
    }
    sites: dict[tuple, dict[str, Any]] = {}
    for ev in events:
        kind = kinds.get(ev.name)
        if kind is None or (end is not None and ev.time_range.start >= end):
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


class SyncLog:
    """While active: CUDA's sync debug mode "warn" (when a GPU is present), and each
    synchronisation warning's Python stack counted by site instead of printed. Other warnings
    pass through unchanged."""

    def __init__(self) -> None:
        self.sites: Counter[tuple[str, ...]] = Counter()
        self._mode: int | None = None
        self._catch: Any = None
        self._shown: Any = warnings.showwarning  # the handler other warnings go to

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            self._shown(message, category, filename, lineno, file, line)
            return
        stack = traceback.extract_stack()[:-1]  # innermost last; drop this method
        frames = [
            f"{'/'.join(Path(f.filename).parts[-2:])}({f.lineno}): {f.name}"
            for f in reversed(stack)
            if Path(f.filename).name != "warnings.py"  # the warnings machinery calling in
        ]
        # autograd replays its threads' warnings when `backward()` returns: say so, since the
        # Python lines are then the caller's, not the op's
        in_backward = any(f.name == "backward" and "torch" in f.filename for f in stack)
        site = _site(frames)
        self.sites[tuple(["[backward]", *site] if in_backward else site)] += 1

    def __enter__(self) -> SyncLog:
        if torch.cuda.is_available():  # without a device only explicit warnings are logged
            # switched on before the capture: on a fresh process the switch itself warned once
            # (2026-12-03, H200), which is the log's own doing, not the step's
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=".*synchroniz")
        self._shown = warnings.showwarning
        warnings.showwarning = self._show
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)  # restores showwarning and the filters

    def summary(self) -> list[dict[str, Any]]:
        return [{"count": n, "site": list(site)} for site, n in self.sites.most_common()]


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
        self._syncs: SyncLog | None = None

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
            self._syncs = SyncLog().__enter__() if self.device.type == "cuda" else None
        elif step == self.last + 1:
            self.close()

    def close(self) -> None:
        """Stop (if running) and write the files; the summary stays in `self.summary`."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        syncs, self._syncs = self._syncs, None
        if syncs is not None:
            syncs.__exit__(None, None, None)
        with torch.profiler.record_function(_CLOSE_MARK):
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
        summary["debug_sites"] = syncs.summary() if syncs is not None else []
        (self.dir / f"syncs_{tag}.json").write_text(json.dumps(summary, indent=1))
        self.summary = summary
        if self.announce:
            print(f"[lmms-train] {format_summary(summary)}", file=sys.stderr, flush=True)


def format_summary(summary: dict[str, Any]) -> str:
    """One line for the console: waits per kind over the profiled steps."""
    t = summary["totals"]
    parts = [f"{k} {int(v['count'])} ({v['ms']:.1f} ms)" for k, v in t.items()]
    first, last = summary["steps"]
    line = f"profile of steps {first}-{last}: host waits: " + ", ".join(parts)
    for s in summary.get("debug_sites", [])[:6]:
        line += f"\n  sync x{s['count']} at {' <- '.join(s['site'][:3]) or '?'}"
    return line
