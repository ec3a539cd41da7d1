"""Tiny shared benchmark harness: timing, an environment description, RESULTS.md sections.

Standard library only (it imports nothing heavy; it reports numpy/torch versions only when the
benchmark has already imported them). Use from a script in ``benchmarks/<area>/``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import harness

    t = harness.timeit(lambda: work(), repeat=5)          # t.wall_best, t.cpu_best, ...
    table = harness.markdown_table(["case", "items/s"], rows)
    harness.write_section("lmms-pack: packing speed and fill", table, command="python ...")

``write_section`` replaces the section with the same ``## title`` in benchmarks/RESULTS.md (or
appends it), stamped with the date, hardware, software and command, so a rerun refreshes its
own numbers without touching other sections.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = (
    "# Benchmark results\n\n"
    "Measured, not claimed: one section per benchmark, written by `benchmarks/harness.py` "
    "(`write_section`). Each names its date, hardware, software and the command that produced "
    "it; baselines are measured in the same run. Rerunning a benchmark replaces its section.\n"
)


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call over ``repeat`` timed calls: wall clock and this process's CPU time."""

    wall: tuple[float, ...]
    cpu: tuple[float, ...]

    @property
    def wall_best(self) -> float:
        return min(self.wall)

    @property
    def wall_median(self) -> float:
        return sorted(self.wall)[len(self.wall) // 2]

    @property
    def cpu_best(self) -> float:
        return min(self.cpu)


def timeit(fn: Callable[[], object], *, repeat: int = 3, warmup: int = 0) -> Timing:
    """Time ``fn()`` ``repeat`` times after ``warmup`` untimed calls (CPU work; for CUDA,
    synchronise inside ``fn``). CPU time is the honest figure on a shared machine: it counts
    only this process's cycles, while wall time also counts other processes' turns."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return Timing(tuple(wall), tuple(cpu))


def pin_to_one_core() -> int | None:
    """Pin this process to one CPU of its current affinity (Linux); returns it, or None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10
        )
        return rev.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, str]:
    """Date, hardware and software of this run, as short strings."""
    env = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{_cpu_model()}, {os.cpu_count()} logical cores",
        "python": f"{platform.python_implementation()} {platform.python_version()} on {platform.system()} {platform.machine()}",
        "commit": _git_commit(),
    }
    if hasattr(os, "sched_getaffinity"):
        env["affinity"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    if hasattr(os, "getloadavg"):
        env["load average (1 min)"] = f"{os.getloadavg()[0]:.2f}"
    for mod in ("numpy", "torch"):  # only what the benchmark imported itself
        if mod in sys.modules:
            env[mod] = getattr(sys.modules[mod], "__version__", "?")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        env["gpu"] = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    return env


def timing_parser(
    doc: str, *, tokens: list[int], iters: int, warmup: int
) -> argparse.ArgumentParser:
    """A timing benchmark's command line: ``doc`` as its help, ``--tokens`` (the row sizes to
    time), ``--iters`` and ``--warmup`` (timed and untimed calls per case), ``--seed`` and
    ``--write`` (replace the benchmark's RESULTS.md section); the caller adds its shape options."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=tokens)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--write", action="store_true", help="write the section of benchmarks/RESULTS.md"
    )
    return p


def device_ms(fn: Callable[[], object], device: Any, *, warmup: int, iters: int) -> float:
    """Median milliseconds per call of ``fn()`` on a torch ``device`` (CUDA synchronised after
    each call, so the time covers the kernels, not just their launch)."""

    def call() -> None:
        fn()
        if device.type == "cuda":
            sys.modules["torch"].cuda.synchronize(device)

    return timeit(call, repeat=iters, warmup=warmup).wall_median * 1e3


def torch_meta(dtype: object, shape: str) -> dict[str, str]:
    """``environment()`` plus the dtype, shape and command of a torch benchmark, and a one-line
    ``header`` naming the device (for ``report``)."""
    meta = {**environment(), "dtype": str(dtype), "shape": shape}
    meta["command"] = "python " + " ".join(sys.argv)
    device = meta.get("gpu", meta["cpu"])
    meta["header"] = f"# {device}, torch {meta.get('torch', '?')}, {dtype}, {shape}"
    return meta


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are printed as given by the caller (format them first)."""
    lines = [
        "| " + " | ".join(map(str, headers)) + " |",
        "|" + "|".join(" --- " for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def write_section(title: str, body: str, *, command: str, results: Path = RESULTS) -> str:
    """Put ``## title`` with an environment block and ``body`` into RESULTS.md; returns the section."""
    env = environment()
    stamp = "\n".join(f"- {k}: {v}" for k, v in env.items())
    section = f"## {title}\n\n{stamp}\n- command: `{command}`\n\n{body.strip()}\n"
    text = results.read_text() if results.exists() else HEADER
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\n") == f"## {title}"), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        tail = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    results.write_text(text)
    return section


def fmt(x: object) -> str:
    """A table cell: ``-`` for None, 3 significant digits below 10, one decimal above."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"
    return str(x)


def report(
    name: str, title: str, rows: list[dict], cols: list[str], meta: dict, *, write: bool
) -> None:
    """Write ``{meta, rows}`` as JSON to $OUT (if set), the RESULTS.md section if ``write``
    (``meta["command"]``), and print ``meta["header"]`` and the table last."""
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        Path(out, f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown_table(cols, [[fmt(r.get(c)) for c in cols] for r in rows])
    if write:
        write_section(title, table, command=meta["command"])
    print(meta["header"])
    print(table)
