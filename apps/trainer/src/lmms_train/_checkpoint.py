"""Checkpoints of a run: lmms_parallel's DCP `Checkpointer` plus the trainer's per-rank state.

A checkpoint under `<output_dir>/checkpoints/step_000123/` holds model and optimizer shards
(DCP, reshardable) and, per rank, `extra_rank{r}.pt`: scheduler, counters, every RNG stream and
the data loader's position. Together they make a resumed run reproduce the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from lmms_train._dist import DistEnv
from lmms_train._errors import ConfigError, UserError
from lmms_train._state import TrainState, get_rng_state, set_rng_state

__all__ = ["RunCheckpointer"]


class RunCheckpointer:
    def __init__(self, out_dir: Path, keep_last: int) -> None:
        from lmms_parallel import Checkpointer

        self.ckpt = Checkpointer(out_dir / "checkpoints", keep_last=keep_last)

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
        if not (path / "COMPLETE").exists():
            raise ConfigError(
                f"trainer_args.resume_from: {resume_from!r} is not a complete checkpoint folder"
            )
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
        extra = {
            "scheduler": scheduler.state_dict(),
            "train_state": state.state_dict(),
            "rng": get_rng_state(),
            "data": data_state,
            "world_size": env.world_size,
            "dp_size": env.dp_size,
        }
        with self._quiet(env):
            return self.ckpt.save(step, model=model, optimizer=optimizer, extra_state=extra)

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
    ) -> None:
        try:
            with self._quiet(env):
                extra = self.ckpt.load(path, model=model, optimizer=optimizer)
        except (FileNotFoundError, RuntimeError) as exc:
            raise UserError(f"could not resume from {path}: {exc}") from exc
        scheduler.load_state_dict(extra["scheduler"])
        state.load_state_dict(extra["train_state"])
        if extra.get("dp_size") == env.dp_size:
            data.load_state_dict(extra["data"])
            set_rng_state(extra["rng"])
        elif env.is_main:
            print(
                f"[lmms-train] resuming at data-parallel size {env.dp_size} from a checkpoint of "
                f"size {extra.get('dp_size')}: the data order restarts from the dataset's seed",
                flush=True,
            )
