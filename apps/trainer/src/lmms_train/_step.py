"""One optimizer step over the step's micro-batches, with globally normalised loss.

The loss of a step is sum(token losses) / (supervised tokens in the *global* batch: every
micro-batch of every data-parallel rank). The step's packs are fetched first, their counts are
all-reduced once, and each micro-batch's backward runs on `loss_sum * grad_scale / global_count`,
where `grad_scale` undoes the averaging the gradient reduction does (FSDP2 averages over its
mesh). So GA, DP world size, packing and SP never change the loss or the gradient. Gradients are
reduced only after the last micro-batch (`set_requires_gradient_sync(False)` before).

Host synchronisation: the micro-batch losses are summed on the device, the grad norm stays a
device tensor, and the loop reads both with one device-to-host copy (`read_scalars`) after the
optimizer step is queued. That copy waits for the whole step's work, so it is the step's only
synchronisation and the end of its timing (`Timer.stop`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PhaseTimer",
    "StepStats",
    "Timer",
    "batch_stats",
    "grad_norm",
    "move_batch",
    "read_scalars",
    "run_micro_batches",
]

# Per-step sums all-reduced in one call (order matters: see `batch_stats`).
STAT_KEYS = (
    "loss_tokens",
    "tokens",
    "samples",
    "vision_tokens",
    "flops_lm",
    "flops_vision",
    "capacity",
    "packs",
    "data_wait",
    "stop",
)


@dataclass(kw_only=True, slots=True)
class StepStats:
    sums: dict[str, float]
    seq_min: float
    seq_max: float


def _seq_lens(batch: dict[str, Any]) -> list[int]:
    cu = batch["cu_seqlens"]
    n = int(batch.get("num_samples", len(cu) - 1))
    lens = (cu[1:] - cu[:-1])[:n]
    return [int(x) for x in lens.tolist()]


def batch_stats(
    batches: list[dict[str, Any]], *, flops_fn, packing_length: int
) -> tuple[dict[str, float], list[int]]:
    """This rank's sums for the step's micro-batches and the list of its sample lengths."""
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    all_lens: list[int] = []
    for b in batches:
        lens = _seq_lens(b)
        all_lens += lens
        sums["loss_tokens"] += int(b["num_loss_tokens"])
        sums["tokens"] += sum(lens)
        sums["samples"] += len(lens)
        sums["vision_tokens"] += int(b.get("vision_tokens", 0))
        lm, vis = flops_fn(b, lens)
        sums["flops_lm"] += lm
        sums["flops_vision"] += vis
        sums["capacity"] += max(packing_length, int(b["input_ids"].shape[-1]))
        sums["packs"] += 1
    return sums, all_lens


def move_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors to `device` (pinned + non_blocking on CUDA); other entries unchanged."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.device != device:
            if device.type == "cuda":
                v = v.pin_memory() if not v.is_pinned() else v
                v = v.to(device, non_blocking=True)
            else:
                v = v.to(device)
        out[k] = v
    return out


def run_micro_batches(
    *,
    model: torch.nn.Module,
    forward,  # (model, batch) -> (loss_sum, n_tokens)
    batches: list[dict[str, Any]],
    device: torch.device,
    scale: float,
    autocast_dtype: torch.dtype | None,
    phases: PhaseTimer | None = None,
) -> torch.Tensor:
    """Forward+backward every micro-batch; returns this rank's summed (unscaled) loss as a
    float64 tensor on `device` (never read here: no host synchronisation per micro-batch)."""
    phases = phases or PhaseTimer(enabled=False, device=device)
    can_toggle = hasattr(model, "set_requires_gradient_sync")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if can_toggle:
            model.set_requires_gradient_sync(last)
        batch = move_batch(batch, device)
        ctx = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        phases.mark("data")  # host-to-device copy of the batch, counted apart
        with ctx:
            loss_sum, _ = forward(model, batch)
        phases.mark("forward")
        (loss_sum.float() * scale).backward()
        phases.mark("backward")
        total += loss_sum.detach().to(torch.float64)
    return total


def grad_norm(model: torch.nn.Module, max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip the global gradient norm (0: no clipping); returns the norm as a device tensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2: all-reduced on the device
        norm = norm.full_tensor()
    return norm


def read_scalars(*values: torch.Tensor) -> list[float]:
    """Device scalars to Python floats in one device-to-host copy (float64 holds a float32
    exactly, so each value equals `float(value)`)."""
    device = values[0].device
    stacked = torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values])
    return stacked.tolist()


class PhaseTimer:
    """Time between marks, attributed to the phase each mark ends (`time/<name>`, summed).

    On CUDA the marks are events, so marking never synchronises; `read()` is called after the
    step's own synchronisation. On CPU (synchronous) they are wall-clock readings.
    """

    def __init__(self, *, enabled: bool, device: torch.device) -> None:
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((name, ev))
        else:
            self._marks.append((name, time.perf_counter()))

    def read(self) -> dict[str, float]:
        """Seconds per phase since the first mark; clears the marks."""
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[f"time/{name}"] = out.get(f"time/{name}", 0.0) + dt
        self._marks.clear()
        return out


class Timer:
    """Wall-clock step timer with one synchronisation, at the end of the step.

    `now()` never synchronises: a step starts after the previous step's `stop()`, when the
    device is idle, so host readings during the step (e.g. after fetching data, host-only work)
    are correct. `stop()` waits for the device (CUDA) and reads the clock; it follows the step's
    `read_scalars` copy, which has already waited for the stream, so it costs ~nothing more but
    also covers work on side streams (FSDP2's reduce-scatter).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        return time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
