"""Checkpoints of a run: lmms_parallel's DCP `Checkpointer` plus the trainer's per-rank state.

A checkpoint under `<output_dir>/checkpoints/step_000123/` holds model and optimizer shards
(DCP, reshardable) and, per rank, `extra_rank{r}.pt`: scheduler, counters, every RNG stream and
the data loader's position (with the dataset files' fingerprint) and the run's config. Together
they make a resumed run reproduce the uninterrupted one.

Failures are user errors with one line each (docs/failures.md): a save that runs out of disk space
or permission (the partial `.tmp` is removed, earlier checkpoints stay), weights that are not
finite (never written), a resume target that is not a checkpoint, or one of another model shape
(`checkpoint has X, model has Y`, with the config keys that differ).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lmms_train._dist import DistEnv
from lmms_train._errors import (
    ConfigError,
    DataChangedError,
    DivergenceError,
    UserError,
    os_error_message,
)
from lmms_train._state import TrainState, get_rng_state, set_rng_state

__all__ = ["RunCheckpointer", "check_fits", "saved_config", "weights_finite"]


class RunCheckpointer:
    def __init__(self, out_dir: Path, keep_last: int, config: dict[str, Any] | None = None) -> None:
        from lmms_parallel import Checkpointer
        from lmms_train._run_folder import read_lineage

        # the folder's run (its lineage): `latest` and pruning see only its checkpoints
        lineage = read_lineage(out_dir)
        self.ckpt = Checkpointer(out_dir / "checkpoints", keep_last=keep_last, run_id=lineage)
        self.config = config  # stored with every checkpoint: a resume reports what differs

    @property
    def run_id(self) -> str | None:
        return self.ckpt.run_id

    def start_run(self, resume: Path | None, env: DistEnv) -> str:
        """This run's id: the resumed checkpoint's lineage, or a new one (fresh start, or a
        checkpoint saved without one); every later save records it."""
        from lmms_parallel import Checkpointer
        from lmms_train._run_folder import new_run_id

        run_id = Checkpointer.run_of(resume) if resume is not None else None
        if run_id is None:  # the same on every rank: rank 0's
            run_id = env.broadcast_object(new_run_id() if env.is_main else None)
        self.ckpt.run_id = run_id
        return run_id

    def latest_text(self) -> str:
        """The last complete checkpoint, for messages."""
        latest = self.ckpt.latest()
        return f"the last good checkpoint is {latest}" if latest else "no checkpoint was written"

    def resolve(self, resume_from: str | None) -> Path | None:
        """`latest` (must exist), `auto` (latest if any), a checkpoint folder, or None."""
        if resume_from is None:
            return None
        if resume_from in ("latest", "auto"):
            latest = self.ckpt.latest()
            if latest is None and resume_from == "latest":
                raise ConfigError(
                    f"trainer_args.resume_from: latest, but {self.ckpt.root} has no complete "
                    "checkpoint (use `auto` to start fresh when there is none)"
                )
            return latest
        path = Path(resume_from)
        if not path.exists() and (self.ckpt.root / resume_from).exists():
            path = self.ckpt.root / resume_from
        key = "trainer_args.resume_from"
        if not path.exists():
            raise ConfigError(f"{key}: {resume_from!r} does not exist")
        if not path.is_dir():
            raise ConfigError(f"{key}: {resume_from!r} is a file, not a checkpoint folder")
        if (path / "checkpoints").is_dir():  # a run folder: point at its checkpoints
            from lmms_parallel import Checkpointer

            latest = Checkpointer(path / "checkpoints").latest()
            hint = f"its latest is {latest}" if latest else "it has no complete checkpoint"
            raise ConfigError(
                f"{key}: {resume_from!r} is a run folder, not a checkpoint ({hint}; "
                "`latest` resumes this run's own output_dir)"
            )
        if not (path / "COMPLETE").exists() or not (path / ".metadata").exists():
            what = (
                "an unfinished save (no COMPLETE marker)"
                if path.name.endswith(".tmp")
                else ("not a checkpoint folder (no COMPLETE marker or .metadata)")
            )
            raise ConfigError(f"{key}: {resume_from!r} is {what}")
        return path

    def save(
        self,
        *,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainState,
        data_state: dict[str, Any],
        env: DistEnv,
    ) -> Path:
        """`data_state`: the loader's position after the packs of `step` (the loop reads ahead)."""
        if not weights_finite(model, env):
            raise DivergenceError(
                f"training diverged by step {step}: the weights hold NaN/inf values, so no "
                f"checkpoint was written; {self.latest_text()} (lower the learning rate or "
                "max_grad_norm and resume from it)"
            )
        extra = {
            "scheduler": scheduler.state_dict(),
            "train_state": state.state_dict(),
            "rng": get_rng_state(),
            "data": data_state,
            "world_size": env.world_size,
            "dp_size": env.dp_size,
            "config": self.config,
        }
        try:
            with self._quiet(env):
                return self.ckpt.save(step, model=model, optimizer=optimizer, extra_state=extra)
        except (OSError, RuntimeError, CheckpointException) as exc:
            cause = _os_error(exc)
            reason = os_error_message(cause) if cause is not None else None
            if reason is None and "save failed on rank" in str(exc):  # another rank's failure
                reason = " ".join(str(exc).split())
            if reason is None:
                raise
            raise UserError(
                f"could not write the checkpoint of step {step}: {reason}; the partial "
                f"{self.ckpt.path(step).name}.tmp was removed and {self.latest_text()}"
            ) from exc

    @staticmethod
    @contextlib.contextmanager
    def _quiet(env: DistEnv):
        """DCP warns that it runs without a process group: expected on one process."""
        with warnings.catch_warnings():
            if not env.distributed:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def load(
        self,
        path: Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainState,
        data: Any,
        env: DistEnv,
        on_data_change: str = "error",
        differences: list[str] | None = None,
    ) -> None:
        """Load `path` into the run; `differences`: the config keys that differ from the
        checkpoint's (named when the model does not fit it)."""
        check_fits(path, model, differences or [])
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            with self._quiet(env):
                extra = self.ckpt.load(path, model=model, optimizer=optimizer)
        except (Exception, CheckpointException) as exc:  # what the files hold: the user's
            raise UserError(
                f"could not resume from {path}: {_root_cause(exc)} (an incomplete or corrupt "
                "checkpoint: resume from another one)"
            ) from exc
        _follow_config_schedule(optimizer, scheduler, fresh, extra["scheduler"]["last_epoch"])
        state.load_state_dict(extra["train_state"])
        if extra.get("dp_size") != env.dp_size:
            if env.is_main:
                print(
                    f"[lmms-train] resuming at data-parallel size {env.dp_size} from a checkpoint "
                    f"of size {extra.get('dp_size')}: the data order restarts from the dataset's "
                    "seed",
                    flush=True,
                )
            return
        try:
            changed = [d for d in differences or [] if _moves_data(d)]
            if changed:  # the saved position is one of another packing / order / sample shape
                raise DataChangedError(f"the data config changed ({'; '.join(changed)})")
            data.load_state_dict(extra["data"])
        except DataChangedError as exc:
            if on_data_change != "restart":
                raise DataChangedError(
                    f"{exc} since the checkpoint {path} was written: resuming there would read "
                    "other records than it recorded (restore them, or set "
                    "trainer_args.on_data_change: restart to restart the data order)"
                ) from None
            if env.is_main:
                print(f"[lmms-train] {exc}: the data order restarts (on_data_change: restart)")
            return
        except (ValueError, KeyError) as exc:
            raise UserError(f"could not resume the data position from {path}: {exc}") from exc
        set_rng_state(extra["rng"])


def _follow_config_schedule(
    optimizer: torch.optim.Optimizer, scheduler: Any, fresh: list[dict[str, Any]], step: int
) -> None:
    """Resume the schedule at `step` as this run's config defines it: the optimizer's moments
    come from the checkpoint, but its hyperparameters (peak LR, weight decay, betas...) and the
    schedule (max_steps, warmup, kind, min_lr_ratio) are the config's, so a run resumed with a
    longer `max_steps` or another schedule follows the new one from its first step (the saved
    param groups' `lr` is the old schedule's value)."""
    for group, hyper in zip(optimizer.param_groups, fresh, strict=True):
        group.update(hyper)
    scheduler.last_epoch = step
    lrs = [
        base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs


# dataset_config keys a saved data position does not depend on (the others change which records
# are read, in which order, or the samples' lengths that the packer's open bins hold)
_POSITION_FREE = (
    "eval_dataset_path", "generate_synthetic", "bad_record_policy", "max_bad_record_ratio",
    "min_records_for_ratio", "data_folder", "allow_absolute_paths", "processor_path",
    "prefetch_factor", "num_epochs",
)  # fmt: skip


def _moves_data(difference: str) -> bool:
    """Whether a `dataset_config.key...: a -> b` difference invalidates the saved position."""
    key = difference.split(":", 1)[0]
    if not key.startswith("dataset_config."):
        return False
    return key.split(".")[1] not in _POSITION_FREE


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (itself, its cause, or a DCP CheckpointException's failure)."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            todo.extend(f[0] for f in e.failures.values())
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _root_cause(exc: BaseException) -> str:
    """`Type: message` of the error behind `exc` (a DCP CheckpointException's first failure),
    on one line."""
    while isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    os_error = _os_error(exc)
    if os_error is not None:
        exc = os_error
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def saved_config(path: Path) -> dict[str, Any] | None:
    """The run config a checkpoint was written with (None for older checkpoints)."""
    try:
        extra = torch.load(path / "extra_rank0.pt", map_location="cpu", weights_only=True)
    except Exception:  # unreadable: the load says so, naming the file
        return None
    config = extra.get("config") if isinstance(extra, dict) else None
    return config if isinstance(config, dict) else None


def check_fits(path: Path, model: torch.nn.Module, differences: list[str]) -> None:
    """Raise a `UserError` naming the first tensors whose shapes differ between the checkpoint's
    model and this one (read from DCP's metadata: nothing is loaded)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict

    try:
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # a truncated or foreign .metadata file
        raise UserError(
            f"could not read the checkpoint {path}: .metadata: {_root_cause(exc)} (an incomplete "
            "or corrupt checkpoint: resume from another one)"
        ) from exc
    saved = {
        k.removeprefix("model."): list(v.size)
        for k, v in meta.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    model_sd, _ = get_state_dict(model, [])
    mine = {k: list(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    shapes = [
        f"checkpoint has {k} {saved[k]}, model has {mine[k]}"
        for k in mine
        if k in saved and saved[k] != mine[k]
    ]
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    found = shapes + [f"model has {k}, checkpoint has not" for k in missing[:1]]
    found += [f"checkpoint has {k}, model has not" for k in extra[:1]]
    if not found:
        return
    count = len(shapes) + len(missing) + len(extra)
    more = f" ({count - 1} more differences)" if count > 1 else ""
    config = f"; the config differs from the checkpoint's: {'; '.join(differences)}"
    raise UserError(
        f"the checkpoint {path} does not fit this model: {found[0]}{more}"
        f"{config if differences else ''} (resume with the model config it was written with)"
    )


def weights_finite(model: torch.nn.Module, env: DistEnv) -> bool:
    """True when every trainable parameter (this rank's shards, then all ranks) is finite; one
    host read per call, so it runs only before a save. Frozen parameters never change (and may be
    quantised tensors without elementwise ops: a QLoRA base)."""
    flags = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        t = p.to_local() if hasattr(p, "to_local") else p
        if t.numel():
            flags.append(torch.isfinite(t).all())
    ok = bool(torch.stack(flags).all()) if flags else True
    (bad,) = env.all_reduce([0.0 if ok else 1.0], op="max")
    return bad == 0.0
