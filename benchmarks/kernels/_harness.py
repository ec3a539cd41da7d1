"""Tiny shared timing helpers for the kernel benchmarks (CUDA events on GPU, perf_counter on CPU)."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int) -> float:
    """Median wall time of ``fn()`` in milliseconds after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def peak_mem_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory allocated above the current level while running ``fn()`` once (CUDA only)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"
    return str(x)


def write_json(name: str, payload: dict) -> None:
    """Write ``payload`` to $OUT/<name>.json when the OUT environment variable is set."""
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(payload, f, indent=2)
