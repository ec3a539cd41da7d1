"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, keep-last-K, reshardable.

Layout of ``root/step_000123/``: DCP shards of ``{"model", "optim"}`` (each rank writes its own
shards; any world size can read them back: DCP reshards on load), ``extra_rank{r}.pt`` (trainer,
data and RNG state of rank ``r``: tensors and plain Python values, loaded with
``weights_only=True``) and ``COMPLETE``. A save is written into ``step_000123.tmp`` and renamed by
rank 0 after a barrier, so a crash mid-save leaves the last complete checkpoint as ``latest()``.
A save that fails on any rank (disk full, no permission) removes the partial ``.tmp`` and raises
on every rank, leaving the earlier checkpoints as they were.

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``, which key the
optimizer state by parameter name: any ``torch.optim.Optimizer`` (AdamW, lmms-optim's Muon)
round-trips, also across world sizes.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["Checkpointer"]

_STEP = re.compile(r"^step_(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Save and resume training state under ``root``, keeping the newest ``keep_last`` checkpoints.

    Every method is collective (all ranks call it). ``root`` must be a filesystem all ranks see.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP.match(entry.name)
            if match and (entry / "COMPLETE").exists():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` atomically; returns its final path."""
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        failed: BaseException | None = None
        if _rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as exc:
                failed = exc
        _fail_together(failed, tmp)  # also the barrier: the folder exists for every rank
        try:
            state = _model_optim_state(model, optimizer)
            dcp.save(state, checkpoint_id=str(tmp))
            buf = io.BytesIO()  # serialised in memory, written by Python: a full disk is an OSError
            torch.save(extra_state or {}, buf)
            (tmp / f"extra_rank{_rank()}.pt").write_bytes(buf.getvalue())
        except (OSError, CheckpointException) as exc:  # disk full, permissions: any rank
            failed = exc
        _fail_together(failed, tmp)
        if _rank() == 0:
            try:
                (tmp / "COMPLETE").write_text(f"{step}\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            except OSError as exc:
                failed = exc
        _fail_together(failed, tmp)
        if _rank() == 0:
            _fsync_dir(self.root)
            for old in self.steps()[: -self.keep_last]:
                shutil.rmtree(self.path(old), ignore_errors=True)
        _barrier()
        return final

    def load(
        self,
        path: str | os.PathLike | None = None,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Load ``path`` (default: ``latest()``) into model/optimizer; returns this rank's extra state.

        At a different world size, rank ``r`` gets ``extra_rank{r}.pt`` when it exists, else rank
        0's (data-loader positions must then be re-derived by the caller).
        """
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.root}")
        if not (path / "COMPLETE").exists():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
        state = _model_optim_state(model, optimizer)
        dcp.load(state, checkpoint_id=str(path))
        if optimizer is None:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        extra = path / f"extra_rank{_rank()}.pt"
        if not extra.exists():
            extra = path / "extra_rank0.pt"
        return torch.load(extra, map_location="cpu", weights_only=True)


def _fail_together(failed: BaseException | None, tmp: Path) -> None:
    """Collective: if the save failed on any rank, remove the partial ``tmp`` (rank 0) and raise
    on every rank (the failing rank's own error; the others a RuntimeError naming it), so no
    rank waits at a barrier for one that gave up. The previous checkpoints are not touched."""
    flags = [failed is not None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, failed is not None)
        flags = gathered
    if not any(flags):
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    if failed is not None:
        raise failed
    ranks = [r for r, f in enumerate(flags) if f]
    raise RuntimeError(f"checkpoint save failed on rank(s) {ranks}; {tmp} was removed")


def _model_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
