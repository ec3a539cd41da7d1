"""`train(cfg)`: set up the process group, data, model, optimizer and sinks, then run the loop.

Each concern lives in its own module (`_dist`, `_data_setup`, `_model_setup`, `_optim_setup`,
`_checkpoint`, `_metrics`, `_loop`); this file only wires them in order and owns the run folder.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from lmms_train._checkpoint import RunCheckpointer
from lmms_train._data_setup import build_data, prepare_inputs
from lmms_train._dist import DistEnv, init_distributed
from lmms_train._errors import ConfigError
from lmms_train._flops import peak_flops_for
from lmms_train._forward import make_forward
from lmms_train._loop import Run, train_loop
from lmms_train._metrics import ConsoleSink, JsonlSink, MetricsLogger, TensorBoardSink, WandbSink
from lmms_train._model_setup import build_model, resolve_spec
from lmms_train._oom import out_of_memory
from lmms_train._optim_setup import build_optimizer, build_schedule
from lmms_train._state import TrainState, seed_everything
from lmms_train.config import TrainConfig, config_to_dict

__all__ = ["train"]


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns the last step's metrics (on every rank)."""
    t = cfg.trainer_args
    env = init_distributed(
        device=t.device,
        sp=t.sp_ulysses_degree,
        dp_replicate=t.dp_replicate,
        fsdp=True if t.fsdp is None and t.fsdp_cpu_offload else t.fsdp,  # offload needs FSDP2
    )
    try:
        return _train(cfg, env)
    finally:
        env.close()


def _build_mesh(cfg: TrainConfig, env: DistEnv) -> None:
    if not env.fsdp:
        return
    from lmms_parallel import ParallelDims

    dims = ParallelDims(dp_replicate=env.dp_replicate, dp_shard=-1, sp=env.sp)
    try:
        env.mesh = dims.build_mesh(env.device.type, world_size=env.world_size)
    except ValueError as exc:
        raise ConfigError(
            f"parallel degrees do not fit the world size {env.world_size}: {exc}"
        ) from exc


def _sinks(cfg: TrainConfig, out: Path, resume_step: int | None) -> MetricsLogger:
    t = cfg.trainer_args
    sinks: list[Any] = [JsonlSink(out / "metrics.jsonl", resume_step=resume_step)]
    if "console" in t.report_to:
        sinks.append(ConsoleSink(t.max_steps, initial=resume_step or 0, every=t.logging_steps))
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


def _train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    t = cfg.trainer_args
    out = Path(t.output_dir)
    _build_mesh(cfg, env)
    spec = resolve_spec(cfg)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    token_ids = prepare_inputs(cfg, env, spec)  # synthetic data / local processor if configured
    seed_everything(t.seed)
    built = build_model(cfg, env, spec, token_ids)
    optimizer = build_optimizer(built.model, spec, t, built.master)
    scheduler = build_schedule(optimizer, t)
    data, eval_data = build_data(cfg, env, spec)
    checkpointer = RunCheckpointer(out, t.save_total_limit)
    state = TrainState()
    resume = checkpointer.resolve(t.resume_from)
    seed_everything(t.seed + 1000 * env.rank)  # per-rank streams (dropout etc.) after the init
    if resume is not None:
        checkpointer.load(
            resume,
            model=built.state_module,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            data=data,
            env=env,
        )
        if built.master is not None:
            built.master.copy_to_model()
        if env.is_main:
            print(
                f"[lmms-train] resumed from {resume} at step {state.step}",
                file=sys.stderr,
                flush=True,
            )
    logger = (
        _sinks(cfg, out, state.step if resume is not None else None)
        if env.is_main
        else MetricsLogger([])
    )
    run = Run(
        cfg=cfg,
        env=env,
        spec=spec,
        model=built.model,
        state_model=built.state_module,
        hf_config=built.hf_config,
        forward=make_forward(
            spec,
            built.model,
            env,
            loss_backend=cfg.trainer_args.loss_backend,
            objective=built.objective,
            seed=t.seed,
        ),
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        eval_data=eval_data,
        checkpointer=checkpointer,
        logger=logger,
        state=state,
        peak_flops=peak_flops_for(env.device, t.peak_flops),
    )
    try:
        last = train_loop(run)
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(exc, cfg, state.step + 1, env.device) from exc
    finally:
        logger.close()
    if t.export_hf and state.step >= t.max_steps:
        from lmms_train._data_setup import _processor_path
        from lmms_train._export import export_run

        export_run(built.model, out / "hf", weights=built.state_module,
                   processor_path=_processor_path(cfg), dtype=t.export_dtype)  # fmt: skip
    if env.is_main:
        _plot_quietly(out)
    return last


def _plot_quietly(out: Path) -> None:
    try:
        from lmms_train._plot import plot_run

        plot_run(out)
    except Exception as exc:  # a missing plot never fails a finished run
        print(f"[lmms-train] could not plot metrics: {exc}", file=sys.stderr)
