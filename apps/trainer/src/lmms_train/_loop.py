"""The training loop: fetch a step's packs, one normalised step, metrics, eval, checkpoints.

A step's metrics are read one step late: after step N's work is queued, step N-1's loss and grad
norm (copied to pinned memory without waiting, `PendingScalars`) are read and logged, so the host
stays a step ahead and never idles the device. Eval, checkpoints and the last step read the
current step at once (the device drains there anyway). A stop request (SIGTERM) is all-reduced
with the next step's statistics, before that step runs: the last finished step is saved at that
boundary (`_stop`), and a wait for data is interruptible (`_read`). A non-finite loss is
therefore raised one step late, before anything is saved (`_guard`: the divergence guard).

The next step's packs are read while this step's backward runs (`_fetch`: right after the last
backward is queued, before the optimizer step), and the first of them is copied to the device
there, so the loader's wait, the host-side statistics and the pinned copy hide behind the GPU's
backward instead of idling it at the step boundary. A checkpoint stores the loader's position from
before that read, so resuming replays those packs.
"""

from __future__ import annotations

import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import lmms_kernels
from lmms_train._checkpoint import RunCheckpointer
from lmms_train._dist import DistEnv
from lmms_train._flops import mfu
from lmms_train._gc_clock import GcClock, GcControl
from lmms_train._guard import DivergenceGuard, drop_update
from lmms_train._metrics import MetricsLogger
from lmms_train._profile import StepProfiler
from lmms_train._slow_steps import SlowSteps
from lmms_train._state import TrainState
from lmms_train._step import (
    STAT_KEYS,
    PendingScalars,
    PhaseTimer,
    StepClock,
    batch_stats,
    grad_norm,
    move_batch,
    run_micro_batches,
)
from lmms_train.config import TrainConfig

__all__ = ["Run", "train_loop"]


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, assembled by `lmms_train._trainer`."""

    cfg: TrainConfig
    env: DistEnv
    spec: Any
    model: torch.nn.Module
    state_model: torch.nn.Module  # what checkpoints hold: `model`, or its fp32 masters
    hf_config: Any
    forward: Any  # (model, batch) -> (loss_sum, n_tokens)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: Any  # train data: iterator of packed batches with state_dict()
    eval_data: Any  # None, or callable(n) -> list of packed batches
    checkpointer: RunCheckpointer
    logger: MetricsLogger
    state: TrainState = field(default_factory=TrainState)
    peak_flops: float = 1.0
    stop_requested: bool = False
    waiting_for_data: bool = False  # inside the data wait: SIGTERM interrupts it
    stopped: bool = False  # the loop ended before max_steps on SIGTERM, after saving
    guard: DivergenceGuard = field(default_factory=DivergenceGuard)  # non-finite values, flat runs
    slow_steps: SlowSteps = field(default_factory=SlowSteps)  # names one-off stalls on stderr


def _flops_fn(run: Run):
    """`(batch, lens) -> (LM, media[, LM with causal attention halved, head FLOPs not run])`:
    the spec's estimators (6N per token + attention); the last is the LM head's 6·H·V for every
    token the head skipped (`loss_rows: labelled`: the batch's `loss_rows` hold the rows run)."""
    spec, conf = run.spec, run.hf_config

    def fn(batch: dict[str, Any], lens: list[int]) -> tuple[float, ...]:
        return spec.pack_flops(conf, batch, lens)

    return fn


def _add_loss_rows(run: Run, batch: dict[str, Any]) -> None:
    """`loss_rows: labelled`: the pack's labelled rows, from its host-side shifted labels
    (before the batch moves to the device; no device read). Causal LM without SP or TP only
    (an SP rank holds a slice of the rows; a TP-sharded head is left to its own path)."""
    t, env = run.cfg.trainer_args, run.env
    labelled = getattr(getattr(run.forward, "objective", None), "labelled_rows", True)
    if t.loss_rows != "labelled" or env.sp > 1 or env.tp > 1 or not labelled:
        return
    shift = batch.get("shift_labels")
    if shift is not None and not (isinstance(shift, torch.Tensor) and shift.device.type != "cpu"):
        batch["loss_rows"] = lmms_kernels.labelled_rows(shift)


def _vision_imbalance(largest: float, total: float, env: Any) -> dict[str, float]:
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


class _DataWaitInterrupted(Exception):
    """SIGTERM arrived while the loop waited for data (a stalled loader cannot hold a run)."""


def _install_sigterm(run: Run) -> Any:
    def handler(signum, frame):
        run.stop_requested = True
        if run.waiting_for_data:  # the wait may never end: leave it (the packs are not needed)
            run.waiting_for_data = False
            raise _DataWaitInterrupted

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


@dataclass(kw_only=True)
class _Fetched:
    """A step's packs, read (the first one already on its way to the device) ahead of it."""

    batches: list[dict[str, Any]]
    sums: dict[str, float]  # this rank's `batch_stats` plus the time blocked on the loader
    lens: list[int]
    data_state: dict[str, Any]  # the loader's position before these packs
    interrupted: bool = False  # SIGTERM came first: no packs were read (the run stops)


def _read(run: Run, data_iter: Any, n: int) -> list[dict[str, Any]]:
    """`n` packs; raises `_DataWaitInterrupted` if SIGTERM came before or comes during the
    wait (the flag is raised before the check, so no signal falls between them)."""
    run.waiting_for_data = True
    try:
        if run.stop_requested:
            raise _DataWaitInterrupted
        return [next(data_iter) for _ in range(n)]
    finally:
        run.waiting_for_data = False


def _interrupted(state: dict[str, Any]) -> _Fetched:
    return _Fetched(batches=[], sums=dict.fromkeys(STAT_KEYS, 0.0), lens=[], data_state=state,
                    interrupted=True)  # fmt: skip


def _fetch(run: Run, data_iter: Any, flops_fn: Any) -> _Fetched | None:
    """Read a step's packs. `data_read` is the host's time blocked on the loader; `data_wait`
    the part of it the device may have idled for: all of it, unless a CUDA event recorded before
    the read is still pending after it (the device was busy with earlier work throughout)."""
    t, env = run.cfg.trainer_args, run.env
    state = run.data.state_dict()
    busy = torch.cuda.Event() if env.device.type == "cuda" else None
    if busy is not None:
        busy.record()
    t0 = time.perf_counter()
    try:
        batches = _read(run, data_iter, t.gradient_accumulation_steps)
    except StopIteration:  # max_steps: -1 and the last pass is over (partial steps dropped)
        return None
    except _DataWaitInterrupted:  # SIGTERM: this step's packs are not needed
        return _interrupted(state)
    read = time.perf_counter() - t0
    for b in batches:
        _add_loss_rows(run, b)
    hidden = busy is not None and not busy.query()  # a status check, not a synchronisation
    packing_length = run.cfg.dataset_config.packing_length
    count_fn = getattr(run.forward, "count_tokens", None)  # the objective's normaliser
    sums, lens = batch_stats(
        batches, flops_fn=flops_fn, packing_length=packing_length, count_fn=count_fn
    )
    sums["data_read"], sums["data_wait"] = read, 0.0 if hidden else read
    batches[0] = move_batch(batches[0], env.device, run.spec.host_keys)  # after the stats' reads
    return _Fetched(batches=batches, sums=sums, lens=lens, data_state=state)


@dataclass(kw_only=True)
class _Queued:
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


def _finish(run: Run, q: _Queued, phases: PhaseTimer) -> dict[str, Any]:
    """Wait for a queued step's scalars (normally long done), then log its metrics."""
    env = run.env
    loss_sum, norm, *pairs = q.values.wait()
    dt = q.clock.seconds()
    local_bad = int(run.data.bad_records()) if hasattr(run.data, "bad_records") else 0
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


def train_loop(run: Run) -> dict[str, Any]:
    """Train until `max_steps` (or SIGTERM); returns the last step's metrics."""
    env, t = run.env, run.cfg.trainer_args
    phases = PhaseTimer(enabled=t.profile_step_breakdown, device=env.device)
    flops_fn = _flops_fn(run)
    previous = _install_sigterm(run)
    last: dict[str, Any] = {}
    queued: _Queued | None = None
    upcoming: _Fetched | None = None  # the next step's packs, read during this step's backward
    data_iter = iter(run.data)
    run.model.train()
    profiler = StepProfiler(
        t.profile_steps, Path(t.output_dir), env.device, env.rank, announce=env.is_main
    )
    gc_clock = GcClock()
    gc_control = GcControl(t.gc_control, t.gc_full_collect_steps, gc_clock)
    graphs_seen = lmms_kernels.compile_counts()["graphs"]
    try:
        if t.compile and t.compile_warmup and not _done(t, run.state.step):
            from lmms_train._warmup import warm_up

            upcoming = _fetch(run, data_iter, flops_fn)  # step 1's packs, read once
            evaluating = bool(t.eval_steps and run.eval_data is not None)
            if upcoming is not None and not upcoming.interrupted:
                warm_up(run, upcoming.batches[0], evaluate=evaluating)
            graphs_seen = lmms_kernels.compile_counts()["graphs"]
        while not _done(t, run.state.step):
            profiler.before_step(run.state.step + 1)
            clock = StepClock(env.device)
            fetched = upcoming or _fetch(run, data_iter, flops_fn)  # the first step reads here
            if t.max_steps < 0 and _out_of_data(run, fetched):  # the last step was the last
                if queued is not None:  # it gets what max_steps would give it: validation...
                    queued.evaluate = bool(t.eval_steps and run.eval_data is not None)
                    last, queued = _finish(run, queued, phases), None
                _end_of_data(run)  # ... and the final checkpoint
                break
            upcoming, sums, lens = None, fetched.sums, fetched.lens
            sums["stop"] = float(run.stop_requested)
            reduced = dict(
                zip(STAT_KEYS, env.all_reduce([sums[k] for k in STAT_KEYS]), strict=True)
            )
            if reduced["stop"]:  # SIGTERM on some rank: stop at this step boundary, saved
                if queued is not None:
                    last, queued = _finish(run, queued, phases), None
                _stop(run, fetched.data_state)
                break
            seq_max, neg_min, vision_max = env.all_reduce(
                [float(max(lens, default=0)), -float(min(lens, default=0)), sums["flops_vision"]],
                op="max",
            )
            per_sp = {k: v / env.row_share for k, v in reduced.items()}  # SP/TP ranks share packs
            global_count = per_sp["loss_tokens"]
            phases.mark("start")
            if hasattr(run.forward, "begin_step"):  # the objective's draws are seeded per step
                run.forward.begin_step(run.state.step + 1)
            loss_local = run_micro_batches(
                model=run.model,
                forward=run.forward,
                batches=fetched.batches,
                device=env.device,
                scale=1.0 / max(global_count, 1.0),
                phases=phases,
                host_keys=run.spec.host_keys,
            )
            if not _done(t, run.state.step + 1):
                upcoming = _fetch(run, data_iter, flops_fn)  # the GPU is busy with backward
                phases.mark("data")  # the next pack's copy to the device, not the optimizer's
            plans = run.model if env.tp * env.ep > 1 else None  # norms over TP/EP meshes
            norm = grad_norm(run.optimizer, t.max_grad_norm, env.device, model=plans)
            lr = run.scheduler.get_last_lr()[0]
            skipped = run.guard.skip_update(run.state.step + 1, norm)  # False unless `skip`
            if skipped:
                drop_update(run.optimizer)
                run.state.extra["skipped_steps"] = run.guard.skipped  # saved with checkpoints
            else:
                run.optimizer.step()
                run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            phases.mark("optimizer")  # clipping, optimizer step, scheduler
            env.all_reduce_device_(loss_local)  # async on the device; no-op on one rank
            clock.end()
            names, pairs = _objective_metrics(run)  # all-reduced on the device, not read
            values = PendingScalars(loss_local, norm, *pairs)  # non-blocking copy to pinned memory
            run.state.step += 1
            run.state.tokens_seen += int(per_sp["tokens"])
            run.state.samples_seen += int(per_sp["samples"])
            step = run.state.step
            lm_run = per_sp["flops_lm"] - per_sp["flops_head_skipped"]  # the head as it ran
            host = {
                "lr": lr,
                "flops_total": lm_run + per_sp["flops_vision"],
                "flops_lm": lm_run,
                "flops_half": per_sp["flops_lm_half"]
                - per_sp["flops_head_skipped"]
                + per_sp["flops_vision"],
                "tokens": int(per_sp["tokens"]),
                "loss_tokens": int(global_count),
                "samples": int(per_sp["samples"]),
                "vision_tokens": int(per_sp["vision_tokens"]),
                "tokens_seen": run.state.tokens_seen,
                "perf/global_seq_len_avg": per_sp["tokens"] / max(per_sp["samples"], 1.0),
                "perf/global_seq_len_min": -neg_min,
                "perf/global_seq_len_max": seq_max,
                "packing_fill_ratio": per_sp["tokens"] / max(per_sp["capacity"], 1.0),
                # the slowest data-parallel rank's vision FLOPs over the mean (1 = balanced)
                **_vision_imbalance(vision_max, per_sp["flops_vision"], env),
                **gc_clock.take(),  # this step's host loop (and the previous step's metrics)
            }
            if per_sp["flops_head_skipped"] > 0:
                host["flops_all_rows"] = per_sp["flops_lm"] + per_sp["flops_vision"]
            if run.guard.policy == "skip":  # steps whose update was dropped, so far
                host["skipped_steps"] = run.guard.skipped
            if t.max_steps < 0:  # passes over the data ended so far: the console's ETA
                host["data_passes"] = run.data.passes_done()
            if t.compile:  # a rise after the first steps is a recompile mid-run
                graphs = lmms_kernels.compile_counts()["graphs"]
                host["compile/graphs"] = graphs
                host["compile/new_graphs"] = graphs - graphs_seen  # compiled in this step
                graphs_seen = graphs
            fa4 = lmms_kernels.fa4_variants()
            if fa4 is not None:  # a rise: FA4 compiled (or loaded) a size-picked variant
                host["compile/fa4_variants"] = fa4
                run.slow_steps.note_fa4(step, fa4)
            if queued is not None:  # the previous step: its work finished before this one's
                last = _finish(run, queued, phases)
            evaluating = bool(t.eval_steps and run.eval_data is not None)
            evaluating = evaluating and (step % t.eval_steps == 0 or step == t.max_steps)
            queued = _Queued(
                step=step, clock=clock, values=values, host=host, phases=phases.take(),
                global_count=global_count, data_wait=reduced["data_wait"], data_read=reduced["data_read"],
                evaluate=evaluating, objective_metrics=names, skipped=skipped,
            )  # fmt: skip
            periodic = t.save_steps and step % t.save_steps == 0
            final = step == t.max_steps and t.save_final
            if periodic or final or evaluating or step == t.max_steps:
                last, queued = _finish(run, queued, phases), None
            if periodic or final:  # the loader's position after this step's packs
                _save(run, upcoming.data_state if upcoming else run.data.state_dict())
            gc_control.after_warmup()  # after this process's first step; a no-op after it
            gc_control.safe_point(step, full=bool(periodic or evaluating))
        if queued is not None:
            last = _finish(run, queued, phases)
    finally:
        gc_control.close()
        gc_clock.close()
        profiler.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return last


def _done(t: Any, step: int) -> bool:
    """`max_steps` reached (never with `max_steps: -1`: the run ends with the data)."""
    return 0 < t.max_steps <= step


def _out_of_data(run: Run, fetched: _Fetched | None) -> bool:
    """`max_steps: -1`: whether any rank's stream has ended, so that every rank stops at the
    same step (one host collective per step)."""
    (out,) = run.env.all_reduce([float(fetched is None)], op="max")
    return bool(out)


def _end_of_data(run: Run) -> None:
    """The final checkpoint of a `max_steps: -1` run (unless that step's is written)."""
    latest = run.checkpointer.ckpt.latest()
    done = latest is not None and latest.name == run.checkpointer.ckpt.path(run.state.step).name
    if run.cfg.trainer_args.save_final and run.state.step > 0 and not done:
        _save(run, run.data.state_dict())
    if run.env.is_main:
        print(
            f"[lmms-train] the data's {run.cfg.dataset_config.num_epochs} pass(es) ended after "
            f"step {run.state.step}",
            file=sys.stderr,
            flush=True,
        )


def _objective_metrics(run: Run) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """The step's objective metrics as `(names, [num, den, ...])`, summed over every rank with
    one device all-reduce (the same names on every rank: an objective's set is fixed)."""
    take = getattr(run.forward, "take_metrics", None)
    got = take() if take is not None else {}
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


def _stop(run: Run, data_state: dict[str, Any]) -> None:
    """SIGTERM: checkpoint the last finished step (unless it has one, or none ran) with the
    loader's position after its packs, and end the run (exit 75)."""
    ckpt, step = run.checkpointer.ckpt, run.state.step
    latest = ckpt.latest()
    if step > 0 and (latest is None or latest.name != ckpt.path(step).name):
        _save(run, data_state)
    run.stopped = True
    if run.env.is_main:
        print(f"[lmms-train] SIGTERM: saved step {step} and stopped", file=sys.stderr, flush=True)


def _save(run: Run, data_state: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    path = run.checkpointer.save(
        step=run.state.step,
        model=run.state_model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        state=run.state,
        data_state=data_state,
        env=run.env,
    )
    if run.env.is_main and "console" in run.cfg.trainer_args.report_to:
        print(
            f"[lmms-train] checkpoint {path} ({time.perf_counter() - t0:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
