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

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import lmms_kernels
from lmms_train._checkpoint import RunCheckpointer
from lmms_train._data_source import TrainData
from lmms_train._dist import DistEnv
from lmms_train._forward import ObjectiveForward
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
from lmms_train._step_metrics import Queued, finish, objective_metrics, vision_imbalance
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
    forward: ObjectiveForward  # (model, batch) -> (loss_sum, n_tokens), through the objective
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TrainData  # train data: iterator of packed batches with state_dict()
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
    objective = run.forward.objective
    if t.loss_rows != "labelled" or env.sp > 1 or env.tp > 1 or not objective.labelled_rows:
        return
    shift = batch.get("shift_labels")
    if shift is not None and not (isinstance(shift, torch.Tensor) and shift.device.type != "cpu"):
        batch["loss_rows"] = lmms_kernels.labelled_rows(shift)


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
    count_fn = run.forward.count_tokens  # the objective's normaliser
    sums, lens = batch_stats(
        batches, flops_fn=flops_fn, packing_length=packing_length, count_fn=count_fn
    )
    sums["data_read"], sums["data_wait"] = read, 0.0 if hidden else read
    batches[0] = move_batch(batches[0], env.device, run.spec.host_keys)  # after the stats' reads
    return _Fetched(batches=batches, sums=sums, lens=lens, data_state=state)


def train_loop(run: Run) -> dict[str, Any]:
    """Train until `max_steps` (or SIGTERM); returns the last step's metrics."""
    previous = _install_sigterm(run)
    run.model.train()
    loop = _Loop(run)
    try:
        loop.warm_up()
        while not _done(run.cfg.trainer_args, run.state.step) and loop.step():
            pass
        loop.finish_queued()
    finally:
        loop.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return loop.last


@dataclass(kw_only=True)
class _Stats:
    """A step's pack statistics over every rank (`STAT_KEYS`): `per_sp` counts each SP/TP group's
    packs once; the loader's times are summed over ranks; the extremes are maxima over ranks."""

    per_sp: dict[str, float]
    data_wait: float
    data_read: float
    seq_max: float
    seq_min: float
    vision_max: float  # the largest rank's vision FLOPs

    @property
    def loss_tokens(self) -> float:
        """The loss's normaliser: supervised tokens of the whole global batch."""
        return self.per_sp["loss_tokens"]


def _sum_over_ranks(run: Run, fetched: _Fetched) -> dict[str, float]:
    """The step's `STAT_KEYS` summed over every rank (one host collective), `stop` among them:
    whether any rank got SIGTERM."""
    fetched.sums["stop"] = float(run.stop_requested)
    values = run.env.all_reduce([fetched.sums[k] for k in STAT_KEYS])
    return dict(zip(STAT_KEYS, values, strict=True))


def _step_stats(run: Run, fetched: _Fetched, reduced: dict[str, float]) -> _Stats:
    """The step's statistics from its sums over ranks, and the extremes (a second collective)."""
    env, lens = run.env, fetched.lens
    seq_max, neg_min, vision_max = env.all_reduce(
        [float(max(lens, default=0)), -float(min(lens, default=0)), fetched.sums["flops_vision"]],
        op="max",
    )
    return _Stats(
        per_sp={k: v / env.row_share for k, v in reduced.items()},  # SP/TP ranks share packs
        data_wait=reduced["data_wait"],
        data_read=reduced["data_read"],
        seq_max=seq_max,
        seq_min=-neg_min,
        vision_max=vision_max,
    )


def _optimizer_step(run: Run, phases: PhaseTimer) -> tuple[Any, float, bool]:
    """Clip (the gradient norm), then the optimizer and scheduler step, unless the divergence
    guard drops this update (`on_nonfinite: skip`); returns (norm, the step's lr, skipped)."""
    t, env = run.cfg.trainer_args, run.env
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
    return norm, lr, skipped


def _count_step(state: TrainState, stats: _Stats) -> int:
    """Advance the run's counters past this step; returns its number."""
    state.step += 1
    state.tokens_seen += int(stats.per_sp["tokens"])
    state.samples_seen += int(stats.per_sp["samples"])
    return state.step


def _pack_metrics(run: Run, stats: _Stats, lr: float) -> dict[str, Any]:
    """The step's metrics known on the host when it is queued: lr, FLOPs (MFU's numerators),
    tokens, samples, sequence lengths, packing fill and vision balance."""
    per_sp = stats.per_sp
    head_skipped = per_sp["flops_head_skipped"]  # `loss_rows: labelled`: rows the head skipped
    lm_run = per_sp["flops_lm"] - head_skipped  # the head as it ran
    return {
        "lr": lr,
        "flops_total": lm_run + per_sp["flops_vision"],
        "flops_lm": lm_run,
        "flops_half": per_sp["flops_lm_half"] - head_skipped + per_sp["flops_vision"],
        "tokens": int(per_sp["tokens"]),
        "loss_tokens": int(stats.loss_tokens),
        "samples": int(per_sp["samples"]),
        "vision_tokens": int(per_sp["vision_tokens"]),
        "tokens_seen": run.state.tokens_seen,
        "perf/global_seq_len_avg": per_sp["tokens"] / max(per_sp["samples"], 1.0),
        "perf/global_seq_len_min": stats.seq_min,
        "perf/global_seq_len_max": stats.seq_max,
        "packing_fill_ratio": per_sp["tokens"] / max(per_sp["capacity"], 1.0),
        # the slowest data-parallel rank's vision FLOPs over the mean (1 = balanced)
        **vision_imbalance(stats.vision_max, per_sp["flops_vision"], run.env),
    }


class _Loop:
    """One `train_loop`: the next step's packs read ahead, the step whose metrics are still to
    be read, and the profiler and GC clocks around the steps."""

    def __init__(self, run: Run) -> None:
        t, env = run.cfg.trainer_args, run.env
        self.run = run
        self.phases = PhaseTimer(enabled=t.profile_step_breakdown, device=env.device)
        self.flops_fn = _flops_fn(run)
        self.data_iter = iter(run.data)
        self.last: dict[str, Any] = {}  # the last logged step's metrics
        self.queued: Queued | None = None
        self.upcoming: _Fetched | None = None  # the next step's packs, read during a backward
        self.profiler = StepProfiler(
            t.profile_steps, Path(t.output_dir), env.device, env.rank, announce=env.is_main
        )
        self.gc_clock = GcClock()
        self.gc_control = GcControl(t.gc_control, t.gc_full_collect_steps, self.gc_clock)
        self.graphs_seen = lmms_kernels.compile_counts()["graphs"]

    def close(self) -> None:
        self.gc_control.close()
        self.gc_clock.close()
        self.profiler.close()

    def evaluates(self) -> bool:
        """Whether the run validates at all (`eval_steps` and eval data)."""
        t = self.run.cfg.trainer_args
        return bool(t.eval_steps and self.run.eval_data is not None)

    def evaluates_after(self, step: int) -> bool:
        t = self.run.cfg.trainer_args
        return self.evaluates() and (step % t.eval_steps == 0 or step == t.max_steps)

    def warm_up(self) -> None:
        """`compile_warmup`: compile on step 1's packs (read once, kept for step 1) first."""
        run, t = self.run, self.run.cfg.trainer_args
        if not (t.compile and t.compile_warmup) or _done(t, run.state.step):
            return
        from lmms_train._warmup import warm_up

        self.upcoming = _fetch(run, self.data_iter, self.flops_fn)
        if self.upcoming is not None and not self.upcoming.interrupted:
            warm_up(run, self.upcoming.batches[0], evaluate=self.evaluates())
        self.graphs_seen = lmms_kernels.compile_counts()["graphs"]

    def step(self) -> bool:
        """One training step, its metrics queued (read during the next step); False when the
        run ends here instead: its data is over (`max_steps: -1`) or SIGTERM came."""
        run, env = self.run, self.run.env
        self.profiler.before_step(run.state.step + 1)
        clock = StepClock(env.device)
        fetched = self.upcoming or _fetch(run, self.data_iter, self.flops_fn)  # step 1 reads here
        if run.cfg.trainer_args.max_steps < 0 and _out_of_data(run, fetched):
            self.end_of_data()  # the last step was the last
            return False
        self.upcoming = None
        reduced = _sum_over_ranks(run, fetched)
        if reduced["stop"]:  # SIGTERM on some rank: stop at this step boundary, saved
            self.finish_queued()
            _stop(run, fetched.data_state)
            return False
        stats = _step_stats(run, fetched, reduced)
        loss_local = self.forward_backward(fetched.batches, stats.loss_tokens)
        norm, lr, skipped = _optimizer_step(run, self.phases)
        env.all_reduce_device_(loss_local)  # async on the device; no-op on one rank
        clock.end()
        names, pairs = objective_metrics(run)  # all-reduced on the device, not read
        values = PendingScalars(loss_local, norm, *pairs)  # non-blocking copy to pinned memory
        step = _count_step(run.state, stats)
        host = _pack_metrics(run, stats, lr)
        host.update(self.gc_clock.take())  # this step's host loop (and the last step's metrics)
        host.update(self.run_metrics(step, stats))
        self.queue(Queued(
            step=step, clock=clock, values=values, host=host, phases=self.phases.take(),
            global_count=stats.loss_tokens, data_wait=stats.data_wait, data_read=stats.data_read,
            evaluate=self.evaluates_after(step), objective_metrics=names, skipped=skipped,
        ))  # fmt: skip
        return True

    def forward_backward(self, batches: list[dict[str, Any]], loss_tokens: float) -> Any:
        """Forward and backward over the step's packs, each loss divided by the global batch's
        supervised tokens; the next step's packs are read while the backward runs."""
        run, t = self.run, self.run.cfg.trainer_args
        self.phases.mark("start")
        run.forward.begin_step(run.state.step + 1)  # the objective's draws are seeded per step
        loss_local = run_micro_batches(
            model=run.model,
            forward=run.forward,
            batches=batches,
            device=run.env.device,
            scale=1.0 / max(loss_tokens, 1.0),
            phases=self.phases,
            host_keys=run.spec.host_keys,
        )
        if not _done(t, run.state.step + 1):
            self.upcoming = _fetch(run, self.data_iter, self.flops_fn)  # the GPU runs backward
            self.phases.mark("data")  # the next pack's copy to the device, not the optimizer's
        return loss_local

    def run_metrics(self, step: int, stats: _Stats) -> dict[str, Any]:
        """The step's metrics about the run rather than its packs: LM-head FLOPs of every row,
        skipped updates, passes over the data, compiled graphs and FA4 variants."""
        run, t, per_sp = self.run, self.run.cfg.trainer_args, stats.per_sp
        host: dict[str, Any] = {}
        if per_sp["flops_head_skipped"] > 0:
            host["flops_all_rows"] = per_sp["flops_lm"] + per_sp["flops_vision"]
        if run.guard.policy == "skip":  # steps whose update was dropped, so far
            host["skipped_steps"] = run.guard.skipped
        if t.max_steps < 0:  # passes over the data ended so far: the console's ETA
            host["data_passes"] = run.data.passes_done()
        if t.compile:  # a rise after the first steps is a recompile mid-run
            graphs = lmms_kernels.compile_counts()["graphs"]
            host["compile/graphs"] = graphs
            host["compile/new_graphs"] = graphs - self.graphs_seen  # compiled in this step
            self.graphs_seen = graphs
        fa4 = lmms_kernels.fa4_variants()
        if fa4 is not None:  # a rise: FA4 compiled (or loaded) a size-picked variant
            host["compile/fa4_variants"] = fa4
            run.slow_steps.note_fa4(step, fa4)
        return host

    def queue(self, q: Queued) -> None:
        """Queue a step's metrics after logging the previous step's (its work is done by now);
        read them at once where the device drains anyway: validation, a checkpoint, the last
        step. Then the checkpoint and the GC's safe point."""
        run, t, step = self.run, self.run.cfg.trainer_args, q.step
        self.finish_queued()
        self.queued = q
        periodic = t.save_steps and step % t.save_steps == 0
        final = step == t.max_steps and t.save_final
        if periodic or final or q.evaluate or step == t.max_steps:
            self.finish_queued()
        if periodic or final:  # the loader's position after this step's packs
            _save(run, self.upcoming.data_state if self.upcoming else run.data.state_dict())
        self.gc_control.after_warmup()  # after this process's first step; a no-op after it
        self.gc_control.safe_point(step, full=bool(periodic or q.evaluate))

    def finish_queued(self) -> None:
        """Read and log the queued step's metrics, if a step is queued."""
        if self.queued is not None:
            self.last, self.queued = finish(self.run, self.queued, self.phases), None

    def end_of_data(self) -> None:
        """`max_steps: -1` and the data is over: the last step gets what `max_steps` would give
        it, validation and the final checkpoint."""
        if self.queued is not None:
            self.queued.evaluate = self.evaluates()
        self.finish_queued()
        _end_of_data(self.run)


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
