"""`train(cfg)`: set up the process group, data, model, optimizer and sinks, then run the loop.

Each concern lives in its own module (`_dist`, `_data_setup`, `_model_setup`, `_optim_setup`,
`_checkpoint`, `_metrics`, `_loop`); this file only wires them in order and owns the run folder.

The order puts what fails on the user's input before what costs time (docs/failures.md): the
config and file-system checks (`_preflight`), the output folder's lock, the resume target and
how its config differs, the data (every shard's metadata is read), then the model; the run's
`config.yaml` is written only once the checkpoint to resume from has loaded, so a run that
fails to start leaves the folder as it was.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from lmms_train._banner import end_summary, start_banner
from lmms_train._checkpoint import RunCheckpointer, saved_config
from lmms_train._data_setup import build_data, prepare_inputs
from lmms_train._data_source import TrainData
from lmms_train._dist import DistEnv, init_distributed
from lmms_train._errors import ConfigError, UserError
from lmms_train._flops import peak_flops_for
from lmms_train._forward import make_forward
from lmms_train._guard import DivergenceGuard, vocab_size_of
from lmms_train._loop import Run, train_loop
from lmms_train._metrics import ConsoleSink, JsonlSink, MetricsLogger, TensorBoardSink, WandbSink
from lmms_train._model_setup import BuiltModel, build_model, resolve_spec
from lmms_train._oom import out_of_memory
from lmms_train._optim_setup import build_optimizer, build_schedule
from lmms_train._preflight import RunLock, config_differences, config_problems
from lmms_train._processor_fit import check_processor_fits
from lmms_train._state import TrainState, seed_everything
from lmms_train.config import TrainConfig, config_to_dict

__all__ = ["TrainOutcome", "run_training", "train"]


@dataclass(kw_only=True, slots=True)
class TrainOutcome:
    metrics: dict[str, Any]  # the last step's
    stopped: bool  # ended early on SIGTERM, after writing a checkpoint (the CLI exits 75)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns the last step's metrics (on every rank)."""
    return run_training(cfg).metrics


def run_training(cfg: TrainConfig) -> TrainOutcome:
    """Train as configured; says whether the run finished or stopped on SIGTERM."""
    t = cfg.trainer_args
    problems = config_problems(cfg)  # nothing started yet: every rank finds the same ones
    if problems:
        raise ConfigError(problems)
    env = init_distributed(
        device=t.device,
        sp=t.sp_ulysses_degree,
        dp_replicate=t.dp_replicate,
        fsdp=True if t.fsdp is None and t.fsdp_cpu_offload else t.fsdp,  # offload needs FSDP2
        tp=t.tp_degree,
        ep=t.ep_degree,
    )
    try:
        lock = RunLock(Path(t.output_dir))
        _on_main(env, lock.acquire)  # one run per output folder
        try:
            return _train(cfg, env)
        finally:
            lock.release()
    finally:
        env.close()


def _on_main(env: DistEnv, fn: Any) -> None:
    """Run `fn` on rank 0; if it raises, every rank stops (rank 0 with its error)."""
    error: BaseException | None = None
    if env.is_main:
        try:
            fn()
        except (UserError, OSError) as exc:
            error = exc
    (failed,) = env.all_reduce([float(error is not None)], op="max")
    if error is not None:
        raise error
    if failed:
        raise UserError("rank 0 could not start the run (its error says why)")


def _build_mesh(cfg: TrainConfig, env: DistEnv) -> None:
    if not env.fsdp:
        return
    from lmms_parallel import ParallelDims

    dims = ParallelDims(dp_replicate=env.dp_replicate, dp_shard=-1, sp=env.sp, tp=env.tp, ep=env.ep)
    try:
        env.mesh = dims.build_mesh(env.device.type, world_size=env.world_size)
    except (ValueError, NotImplementedError) as exc:
        raise ConfigError(
            f"parallel degrees do not fit the world size {env.world_size}: {exc}"
        ) from exc


def _memory_plan(cfg: TrainConfig, env: DistEnv, spec: Any, token_ids: Any) -> None:
    """`trainer_args.memory` on a CUDA run: stop before building a model that would not fit,
    or (auto) choose the fastest layout that fits (lmms_train._memory_fit)."""
    if cfg.trainer_args.memory == "off" or env.device.type != "cuda":
        return
    from lmms_train._memory import device_gib
    from lmms_train._memory_fit import memory_preflight

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if env.is_main else (lambda _: None)
    memory_preflight(cfg, spec, token_ids, gpus=env.world_size, capacity_gib=device_gib(), log=log,
                     vary_replicas=env.fsdp and env.sp == env.tp == env.ep == 1)  # fmt: skip
    if env.fsdp and cfg.trainer_args.dp_replicate != env.dp_replicate:  # auto's FSDP2 degree
        env.dp_replicate = cfg.trainer_args.dp_replicate  # same choice on every rank
        _build_mesh(cfg, env)


def _sinks(cfg: TrainConfig, out: Path, resume_step: int | None) -> MetricsLogger:
    t = cfg.trainer_args
    sinks: list[Any] = [JsonlSink(out / "metrics.jsonl", resume_step=resume_step)]
    if "console" in t.report_to:
        sinks.append(ConsoleSink(t.max_steps, initial=resume_step or 0, every=t.logging_steps,
                                 passes=cfg.dataset_config.num_epochs))  # fmt: skip
    if "wandb" in t.report_to:
        sinks.append(
            WandbSink(
                project=t.wandb_project,
                name=t.run_name or out.name,
                mode=t.wandb_mode,
                out_dir=out,
                config=config_to_dict(cfg),
                resume=resume_step is not None,
            )
        )
    if "tensorboard" in t.report_to:
        sinks.append(TensorBoardSink(out))
    return MetricsLogger(sinks)


def _train(cfg: TrainConfig, env: DistEnv) -> TrainOutcome:
    t = cfg.trainer_args
    out = Path(t.output_dir)
    started = time.perf_counter()
    _build_mesh(cfg, env)
    spec = resolve_spec(cfg)
    start = _start_point(cfg, env, out)
    token_ids = prepare_inputs(cfg, env, spec)  # synthetic data / local processor if configured
    check_processor_fits(cfg, spec, token_ids)  # its patches / family vs the model's: one line
    data, eval_data = build_data(cfg, env, spec)  # reads every shard's metadata: before the model
    built = _model(cfg, env, spec, token_ids, data)
    optimizer = _optimizer(built, spec, t)
    scheduler = build_schedule(optimizer, t)
    state = TrainState()
    seed_everything(t.seed + 1000 * env.rank)  # per-rank streams (dropout etc.) after the init
    if start.resume is not None:
        _resume(cfg, env, start, built, optimizer=optimizer, scheduler=scheduler, state=state,
                data=data)  # fmt: skip
    if env.is_main:  # only now: a run that could not start leaves the folder's config alone
        _claim_folder(out, start.run_id, start.resume, overwrite=t.overwrite_output_dir)
        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        banner = start_banner(cfg, env, spec, built.state_module, out=out, resumed=start.resume,
                              step=state.step)  # fmt: skip
        print(banner, file=sys.stderr, flush=True)
    resume_step = state.step if start.resume is not None else None
    run = Run(
        cfg=cfg,
        env=env,
        spec=spec,
        model=built.model,
        state_model=built.state_module,
        hf_config=built.hf_config,
        forward=_forward(cfg, env, spec, built),
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        eval_data=eval_data,
        checkpointer=start.checkpointer,
        logger=_sinks(cfg, out, resume_step) if env.is_main else MetricsLogger([]),
        state=state,
        peak_flops=peak_flops_for(env.device, t.peak_flops),
        guard=_guard(cfg, env, built, start.checkpointer, state),
    )
    last = _run_loop(run)
    if t.export_hf and state.step >= t.max_steps and not run.stopped:
        _export(cfg, spec, built, optimizer)
    if env.is_main:
        _plot_quietly(out)
        summary = end_summary(out=out, steps=state.step, max_steps=t.max_steps,
                              tokens=state.tokens_seen, seconds=time.perf_counter() - started,
                              metrics=last, stopped=run.stopped,
                              checkpoint=start.checkpointer.ckpt.latest(),
                              exported=t.export_hf and (out / "hf").is_dir())  # fmt: skip
        print(summary, file=sys.stderr, flush=True)
    return TrainOutcome(metrics=last, stopped=run.stopped)


@dataclass(kw_only=True, slots=True)
class _StartPoint:
    """Where a run starts: its checkpointer, the checkpoint to resume from (None: a fresh
    start), the lineage id of its folder, and the model/data keys that differ from the
    checkpoint's config."""

    checkpointer: RunCheckpointer
    resume: Path | None
    run_id: str
    differences: list[str]


def _start_point(cfg: TrainConfig, env: DistEnv, out: Path) -> _StartPoint:
    """The resume target and how its config differs, found (and said) before the data."""
    t = cfg.trainer_args
    checkpointer = RunCheckpointer(out, t.save_total_limit, config_to_dict(cfg))
    resume = checkpointer.resolve(t.resume_from)
    run_id = checkpointer.start_run(resume, env)
    differences = _differences(cfg, env, resume)
    return _StartPoint(
        checkpointer=checkpointer, resume=resume, run_id=run_id, differences=differences
    )


def _model(
    cfg: TrainConfig, env: DistEnv, spec: Any, token_ids: Any, data: TrainData
) -> BuiltModel:
    """The model, built once the data is known good: the memory plan first (it may stop the
    run, or choose its layout), then the build; the loader's vision balancing gets its cost."""
    seed_everything(cfg.trainer_args.seed)
    _memory_plan(cfg, env, spec, token_ids)  # may stop the run, or choose its layout (auto)
    built = build_model(cfg, env, spec, token_ids)
    data.set_vision_cost(functools.partial(spec.pack_vision_flops, built.hf_config))
    return built


def _optimizer(built: BuiltModel, spec: Any, t: Any) -> torch.optim.Optimizer:
    optimizer = build_optimizer(built.model, spec, t, built.master)
    if t.ema_decay is not None:  # EMA of the weights, in the optimizer's state (_ema)
        from lmms_train._ema import install_ema

        install_ema(optimizer, t.ema_decay)
    return optimizer


def _resume(
    cfg: TrainConfig,
    env: DistEnv,
    start: _StartPoint,
    built: BuiltModel,
    *,
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    data: Any,
) -> None:
    """Load the checkpoint into the model (its fp32 masters, if any), the optimizer, the
    scheduler, the trainer state and the data's position."""
    start.checkpointer.load(
        start.resume,
        model=built.state_module,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        data=data,
        env=env,
        on_data_change=cfg.trainer_args.on_data_change,
        differences=start.differences,
    )
    if built.master is not None:
        built.master.copy_to_model()
    if env.is_main:
        print(
            f"[lmms-train] resumed from {start.resume} at step {state.step}",
            file=sys.stderr,
            flush=True,
        )


def _forward(cfg: TrainConfig, env: DistEnv, spec: Any, built: BuiltModel) -> Any:
    """`(model, batch) -> (loss_sum, n_tokens)` under the run's objective (the adapter-disabled
    model as the reference of a preference objective under LoRA)."""
    t = cfg.trainer_args
    return make_forward(
        spec,
        built.model,
        env,
        loss_backend=t.loss_backend,
        objective=built.objective,
        seed=t.seed,
        split_vision=t.sp_split_vision,
        reference=None if built.adapter is None else built.adapter.disabled,
    )


def _guard(
    cfg: TrainConfig,
    env: DistEnv,
    built: BuiltModel,
    checkpointer: RunCheckpointer,
    state: TrainState,
) -> DivergenceGuard:
    t = cfg.trainer_args
    return DivergenceGuard(
        policy=t.on_nonfinite,
        max_skips=t.max_nonfinite_skips,
        vocab_size=vocab_size_of(built.hf_config),
        last_good=checkpointer.latest_text,
        announce=env.is_main,
        skipped=int(state.extra.get("skipped_steps", 0)),  # a resumed run's, so far
    )


def _run_loop(run: Run) -> dict[str, Any]:
    """The loop; out of device memory becomes one user error naming the step and the settings."""
    try:
        return train_loop(run)
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(exc, run.cfg, run.state.step + 1, run.env.device) from exc
    finally:
        run.logger.close()


def _export(cfg: TrainConfig, spec: Any, built: BuiltModel, optimizer: Any) -> None:
    """`export_hf`: the trained weights as an HF folder `hf` (LoRA: also `adapter`), and under
    `ema_decay` the EMA weights as `hf_ema` (`adapter_ema`)."""
    out = Path(cfg.trainer_args.output_dir)
    _export_to(cfg, spec, built, out / "hf", out / "adapter")
    if cfg.trainer_args.ema_decay is not None:  # the EMA weights, same layout
        from lmms_train._ema import ema_weights

        with ema_weights(optimizer):
            _export_to(cfg, spec, built, out / "hf_ema", out / "adapter_ema")


def _export_to(
    cfg: TrainConfig, spec: Any, built: BuiltModel, hf_dir: Path, adapter_dir: Path
) -> None:
    from lmms_train._data_setup import _processor_path
    from lmms_train._export import export_run

    t = cfg.trainer_args
    hf = export_run(built.model, hf_dir, weights=built.state_module,
                    processor_path=_processor_path(cfg), dtype=t.export_dtype,
                    adapter=built.adapter, adapter_dir=adapter_dir,
                    writer=spec.export_writer(built.model))  # fmt: skip
    if hf is not None:  # the family's release layout, if any (e.g. a full Omni)
        spec.finish_export(hf, cfg.model_config.load_from_pretrained_path)


def _differences(cfg: TrainConfig, env: DistEnv, resume: Path | None) -> list[str]:
    """The model/data config keys that differ from the resume target's, said once."""
    old = saved_config(resume) if resume is not None else None
    if old is None:
        return []
    differences = config_differences(old, cfg)
    if differences and env.is_main:
        print(
            f"[lmms-train] resuming from {resume} with a model/data config that differs from the "
            f"checkpoint's: {'; '.join(differences)}",
            file=sys.stderr,
            flush=True,
        )
    return differences


def _claim_folder(out: Path, run_id: str, resume: Path | None, *, overwrite: bool) -> None:
    """Make `out` this run's: with `overwrite_output_dir` a fresh run first deletes another
    run's files (the preflight refused them otherwise); then `run.json` names this lineage."""
    from lmms_train._run_folder import (
        clear_previous_run,
        previous_run,
        read_lineage,
        set_aside_metrics,
        write_run_file,
    )

    other = read_lineage(out)
    if resume is not None and other not in (None, run_id):  # resumed another folder's run
        set_aside_metrics(out, other)
    if resume is None and overwrite and previous_run(out):
        removed = clear_previous_run(out)
        print(
            f"[lmms-train] overwrite_output_dir: deleted the previous run's {', '.join(removed)} "
            f"from {out}",
            file=sys.stderr,
            flush=True,
        )
    write_run_file(out, run_id, resume)


def _plot_quietly(out: Path) -> None:
    try:
        from lmms_train._plot import plot_run

        plot_run(out)
    except Exception as exc:  # a missing plot never fails a finished run
        print(f"[lmms-train] could not plot metrics: {exc}", file=sys.stderr)
