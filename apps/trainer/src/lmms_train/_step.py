"""One optimizer step over the step's micro-batches, with globally normalised loss.

The loss of a step is sum(token losses) / (supervised tokens in the *global* batch: every
micro-batch of every data-parallel rank). The step's packs are fetched first, their counts are
all-reduced once, and each micro-batch's backward runs on `loss_sum * grad_scale / global_count`,
where `grad_scale` undoes the averaging the gradient reduction does (FSDP2 averages over its
mesh). So GA, DP world size, packing and SP never change the loss or the gradient. Gradients are
reduced only after the last micro-batch (`set_requires_gradient_sync(False)` before).

Host synchronisation: none in the steady state. The micro-batch losses are summed on the device,
the grad norm stays a device tensor, and after the optimizer step is queued both go to pinned host
memory with one non-blocking copy (`PendingScalars`). The loop reads them one step later, after
the next step's work is queued, so the host never waits for the device while the device still has
work: the only waits are for a copy that has already finished. The step's time comes from CUDA
events recorded at its start and end (`StepClock`), so it is the device's time for the step
(including any time the device idled waiting for the host), not the host's.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from lmms_models import to_device

__all__ = [
    "PendingScalars",
    "PhaseTimer",
    "StepClock",
    "StepStats",
    "batch_stats",
    "grad_norm",
    "move_batch",
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
    "flops_lm_half",
    "flops_head_skipped",
    "capacity",
    "packs",
    "data_wait",
    "data_read",
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
    batches: list[dict[str, Any]], *, flops_fn, packing_length: int, count_fn=None
) -> tuple[dict[str, float], list[int]]:
    """This rank's sums for the step's micro-batches and the list of its sample lengths.
    `count_fn(batch)`: the pack's loss normaliser (the objective's; default `num_loss_tokens`)."""
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    all_lens: list[int] = []
    for b in batches:
        lens = _seq_lens(b)
        all_lens += lens
        sums["loss_tokens"] += int(b["num_loss_tokens"] if count_fn is None else count_fn(b))
        sums["tokens"] += sum(lens)
        sums["samples"] += len(lens)
        sums["vision_tokens"] += int(b.get("vision_tokens", 0))
        lm, vis, *more = flops_fn(b, lens)  # + (LM with causal attention halved, head skipped)
        half, skipped = more if more else (lm, 0.0)
        sums["flops_lm"] += lm
        sums["flops_vision"] += vis
        sums["flops_lm_half"] += half
        sums["flops_head_skipped"] += skipped
        sums["capacity"] += max(packing_length, int(b["cu_seqlens"][-1]))
        sums["packs"] += 1
    return sums, all_lens


def move_batch(
    batch: dict[str, Any], device: torch.device, host_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Tensors to `device` (`lmms_models.to_device`: pinned + non_blocking on CUDA); other entries
    and the `host_keys` (metadata the model spec reads on the host, `ModelSpec.host_keys`)
    unchanged."""
    return {
        k: to_device(v, device) if isinstance(v, torch.Tensor) and k not in host_keys else v
        for k, v in batch.items()
    }


def run_micro_batches(
    *,
    model: torch.nn.Module,
    forward,  # (model, batch) -> (loss_sum, n_tokens)
    batches: list[dict[str, Any]],
    device: torch.device,
    scale: float,
    phases: PhaseTimer | None = None,
    host_keys: tuple[str, ...] = (),
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
        batch = move_batch(batch, device, host_keys)
        phases.mark("data")  # host-to-device copy of the batch, counted apart
        loss_sum, _ = forward(model, batch)
        phases.mark("forward")
        (loss_sum.float() * scale).backward()
        phases.mark("backward")
        total += loss_sum.detach().to(torch.float64)
    return total


def grad_norm(
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    device: torch.device,
    *,
    model: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm of what `optimizer` steps (the model's parameters, or their
    fp32 masters) (0: no clipping); returns the norm as a device tensor. An optimizer with
    `clip_norm_` (`lmms_optim.MasterAdamW`) measures its own gradients and applies the clip
    coefficient in its update, instead of a pass over the gradients here."""
    if hasattr(optimizer, "clip_norm_"):
        return optimizer.clip_norm_(max_norm)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not params:
        return torch.zeros((), device=device)
    if model is not None:  # TP/EP: parameters on several meshes, experts differing per EP rank
        from lmms_parallel import clip_grad_norm_

        return clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, model=model)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2: all-reduced on the device
        norm = norm.full_tensor()
    return norm


class PendingScalars:
    """Device scalars on their way to the host: one non-blocking copy now, `wait()` later.

    On CUDA the values are stacked (float64: exact for float32 values and counts < 2**53) into a
    pinned host buffer with `non_blocking=True` and an event is recorded after the copy; `wait()`
    blocks on that event only. Elsewhere the copy is synchronous and `wait()` just converts.
    """

    def __init__(self, *values: torch.Tensor) -> None:
        device = values[0].device
        stacked = torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values])
        self.event = None
        if device.type == "cuda":
            self.host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = stacked

    def wait(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class StepClock:
    """A step's duration without synchronising: CUDA events at its start and end (the device's
    timeline), wall-clock readings elsewhere. `seconds()` is valid once the end has happened
    (after `PendingScalars.wait()` of a copy queued after `end()`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = self._mark()
        self._end: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self) -> None:
        self._end = self._mark()

    def seconds(self) -> float:
        if self._end is None:
            raise RuntimeError("StepClock.seconds() before end()")
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start


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

    def take(self) -> list[tuple[str, Any]]:
        """This step's marks (the timer starts afresh); pass them to `read` once they happened."""
        marks, self._marks = self._marks, []
        return marks

    def read(self, marks: list[tuple[str, Any]] | None = None) -> dict[str, float]:
        """Seconds per phase since the first mark (of `marks`, default: the current ones, which
        are then cleared). CUDA events must have completed (`Event.elapsed_time` raises if not)."""
        if marks is None:
            marks = self.take()
        out: dict[str, float] = {}
        for (_, a), (name, b) in itertools.pairwise(marks):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[f"time/{name}"] = out.get(f"time/{name}", 0.0) + dt
        return out
