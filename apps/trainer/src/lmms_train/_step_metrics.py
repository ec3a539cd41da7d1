"""A training step's metrics: queued when its device work is queued, read one step late.

`finish` waits for a queued step's scalars (normally long done), logs its metrics, runs
validation where due, and hands the loss and gradient norm to the divergence guard.
`objective_metrics` gathers the objective's and the MoE router's (numerator, denominator) pairs
of the step, all-reduced on the device and read with the loss.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmms_train._flops import mfu
from lmms_train._step import PendingScalars, PhaseTimer, StepClock, move_batch

if TYPE_CHECKING:
    from lmms_train._loop import Run

__all__ = ["Queued", "evaluate", "finish", "objective_metrics", "vision_imbalance"]


def vision_imbalance(largest: float, total: float, env: Any) -> dict[str, float]:
    """``perf/vision_flops_imbalance``: max over data-parallel ranks of a step's vision FLOPs
    over their mean (``total`` counts each SP/TP group's packs once); absent without media."""
    if total <= 0:
        return {}
    return {"perf/vision_flops_imbalance": largest * env.dp_size / total}


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb / 2**20


def evaluate(run: Run) -> float:
    """Mean validation loss over `eval_batches` packs per rank (same packs every time)."""
    model, env = run.model, run.env
    model.eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch in run.eval_data():
            batch = move_batch(batch, env.device, run.spec.host_keys)
            loss_sum, n = run.forward(model, batch)
            total += float(loss_sum)
            count += float(n)
    model.train()
    total, count = env.all_reduce([total, count])
    return total / max(count, 1.0)  # both sums are over-counted by sp alike


@dataclass(kw_only=True)
class Queued:
    """A step whose device work is queued and whose metrics are not read yet."""

    step: int
    clock: StepClock
    values: PendingScalars  # (loss_sum over ranks, grad norm)
    host: dict[str, Any]  # metrics known on the host when the step was queued
    phases: list[tuple[str, Any]]
    global_count: float
    data_wait: float
    data_read: float
    evaluate: bool  # validation after this step (its metrics are then read at once)
    objective_metrics: tuple[str, ...] = ()  # names of the objective's (num, den) pairs in values
    skipped: bool = False  # its update was dropped (non-finite gradient norm, `on_nonfinite: skip`)


def finish(run: Run, q: Queued, phases: PhaseTimer) -> dict[str, Any]:
    """Wait for a queued step's scalars (normally long done), then log its metrics."""
    env = run.env
    loss_sum, norm, *pairs = q.values.wait()
    dt = q.clock.seconds()
    local_bad = run.data.bad_records()
    (bad,) = env.all_reduce([float(local_bad)])  # host-side collective: no device sync
    host = q.host
    metrics: dict[str, Any] = {
        "loss": loss_sum / env.row_share / max(q.global_count, 1.0),
        "lr": host.pop("lr"),
        "grad_norm": norm,
        "tokens_per_sec": host["tokens"] / dt,
        "mfu": mfu(host.pop("flops_total"), dt, env.world_size, run.peak_flops),
        "mfu_lm": mfu(host.pop("flops_lm"), dt, env.world_size, run.peak_flops),
        # attention of causal blocks counted at half (the work a causal kernel does)
        "mfu_causal_half": mfu(host.pop("flops_half"), dt, env.world_size, run.peak_flops),
        "step_time": dt,
        **host,
        "data_wait_fraction": q.data_wait / env.world_size / dt,
        "data_read_fraction": q.data_read / env.world_size / dt,
        "peak_memory_gb": _peak_memory_gb(env.device),
        "bad_records": int(bad / env.row_share),
        **phases.read(q.phases),
    }
    for i, name in enumerate(q.objective_metrics):  # global sums: numerator / denominator
        num, den = pairs[2 * i], pairs[2 * i + 1]
        if den > 0:  # an empty bucket (no sample drew such a t this step) is not logged
            metrics[name] = num / den
    if "flops_all_rows" in host:  # loss_rows: labelled; the head counted on every row
        flops = host.pop("flops_all_rows")
        metrics["mfu_all_rows"] = mfu(flops, dt, env.world_size, run.peak_flops)
    if q.evaluate:
        metrics["eval_loss"] = evaluate(run)
    if env.is_main:
        run.logger.log(q.step, metrics)
        slow = run.slow_steps.check(q.step, metrics)
        if slow:
            print(f"[lmms-train] slow {slow}", file=sys.stderr, flush=True)
    run.guard.check(q.step, metrics["loss"], norm, skipped=q.skipped)  # raises on NaN/inf
    return metrics


def objective_metrics(run: Run) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """The step's objective metrics as `(names, [num, den, ...])`, summed over every rank with
    one device all-reduce (the same names on every rank: an objective's set is fixed)."""
    got = run.forward.take_metrics()
    moe_names, moe_pairs = _moe_metrics(run)
    if not got:
        return moe_names, moe_pairs
    names = tuple(sorted(got))
    stacked = torch.stack([x for n in names for x in got[n]])  # [2k] float64
    run.env.all_reduce_device_(stacked)
    return names + moe_names, list(stacked.unbind()) + moe_pairs


def _moe_metrics(run: Run) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """MoE families: the router aux loss and the experts' load (`lmms_models.ExpertLoadMeter`)
    of the step, the tokens per expert summed over every rank on the device, as (num, den)
    pairs."""
    from lmms_models import expert_load_meter

    meter = expert_load_meter(run.model)
    if meter is None:
        return (), []
    raw = meter.take(run.env.device)
    run.env.all_reduce_device_(raw)
    aux_sum, n_aux, ratio, worst, dead = meter.summarize(raw).double().unbind()
    one = torch.ones((), dtype=torch.float64, device=raw.device)
    names = ("moe/load_max_over_mean", "moe/load_max_over_mean_worst", "moe/dead_experts")
    pairs = [ratio, one, worst, one, dead, one]
    if run.spec.router_aux_enabled(run.model):
        names, pairs = ("moe/aux_loss", *names), [aux_sum, n_aux, *pairs]
    return names, pairs
