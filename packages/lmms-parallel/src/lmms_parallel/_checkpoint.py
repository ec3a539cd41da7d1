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

Expert-parallel parameters (:class:`lmms_parallel.ExpertParallel`: each EP rank holds experts
``[r·E/ep, (r+1)·E/ep)``, FSDP2-sharded further or not) and their optimizer state are written as
*global* ``[E, ...]`` DTensors: a view of the local slice on a mesh ``(ep, *fsdp dims)`` with
``Shard(0)`` over ``ep`` outermost, then the FSDP2 placements. DCP therefore records every
expert at its global offset, and a checkpoint resumes at another EP degree (EP 1 included) or
world size. TP parameters are DTensors already and need nothing.
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
    With ``run_id``, each save records it (a ``RUN`` file) and ``steps()``/``latest()``/pruning
    see only the checkpoints of that run, so another run's checkpoints in ``root`` are never
    resumed or deleted.
    """

    def __init__(
        self, root: str | os.PathLike, *, keep_last: int = 3, run_id: str | None = None
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.run_id = run_id

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (of ``run_id``'s run if set), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP.match(entry.name)
            ours = self.run_id is None or self.run_of(entry) == self.run_id
            if match and (entry / "COMPLETE").exists() and ours:
                found.append(int(match.group(1)))
        return sorted(found)

    @staticmethod
    def run_of(path: str | os.PathLike) -> str | None:
        """The ``run_id`` a checkpoint was saved with (None: saved without one)."""
        try:
            return (Path(path) / "RUN").read_text().strip() or None
        except OSError:
            return None

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
            dcp.save(_ep_global(model, state), checkpoint_id=str(tmp))
            buf = io.BytesIO()  # serialised in memory, written by Python: a full disk is an OSError
            torch.save(extra_state or {}, buf)
            (tmp / f"extra_rank{_rank()}.pt").write_bytes(buf.getvalue())
        except (OSError, CheckpointException) as exc:  # disk full, permissions: any rank
            failed = exc
        _fail_together(failed, tmp)
        if _rank() == 0:
            try:
                if self.run_id is not None:
                    (tmp / "RUN").write_text(f"{self.run_id}\n")
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
        process_group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Load ``path`` (default: ``latest()``) into model/optimizer; returns this rank's extra state.

        At a different world size, rank ``r`` gets ``extra_rank{r}.pt`` when it exists, else rank
        0's (data-loader positions must then be re-derived by the caller). ``process_group``: the
        ranks that load (default: all), e.g. a one-rank group for a one-process model.
        """
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.root}")
        if not (path / "COMPLETE").exists():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
        state = _model_optim_state(model, optimizer)
        dcp.load(  # in place, through views
            _ep_global(model, state), checkpoint_id=str(path), process_group=process_group
        )
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


def _ep_global(model: nn.Module, state: dict) -> dict:
    """``state`` with every expert-parallel tensor (parameter and its optimizer state of the same
    shape) replaced by a global ``[E, ...]`` DTensor viewing the same storage (so DCP loads into
    it in place). Collective when the model has EP parameters (one all-gather of mesh
    coordinates, cached on the module)."""
    from ._ep import ep_params

    found = ep_params(model)
    if not found:
        return state
    model_sd = dict(state["model"])
    optim = state.get("optim")
    optim_state = dict(optim["state"]) if optim is not None else {}
    for fqn, module, _pname, st in found:
        if fqn not in model_sd:
            continue
        local = model_sd[fqn]
        model_sd[fqn] = _global_view(module, st, local)
        if fqn in optim_state:
            entry = dict(optim_state[fqn])
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == local.shape:
                    entry[key] = _global_view(module, st, value)
            optim_state[fqn] = entry
    out = dict(state, model=model_sd)
    if optim is not None:
        out["optim"] = dict(optim, state=optim_state)
    return out


def _global_view(module: nn.Module, st: Any, t: torch.Tensor) -> torch.Tensor:
    """The EP-local ``t`` (plain ``[E/ep, ...]`` or an FSDP2 DTensor of it) as the global
    ``[E, ...]`` DTensor on the mesh ``(ep, *rest)``: ``Shard(0)`` over ep (contiguous expert
    blocks), then the FSDP2 placements (or ``Replicate`` over the ranks holding the same
    experts)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = t.to_local() if isinstance(t, DTensor) else t
    inner = list(t.placements) if isinstance(t, DTensor) else [Replicate()]
    mesh = _ep_mesh(module, st, t, local.device.type)
    shape = (st.n_experts, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [Shard(0), *inner], run_check=False, shape=torch.Size(shape), stride=stride
    )


def _ep_mesh(module: nn.Module, st: Any, t: torch.Tensor, device_type: str) -> Any:
    """The ``(ep, *rest)`` mesh of the ranks holding ``module``'s experts (built once; no
    process groups: DCP only reads the coordinates)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    key = "_lmms_ep_ckpt_mesh"
    cached = getattr(module, key, None)
    if cached is not None:
        return cached
    if isinstance(t, DTensor):
        rest_shape = tuple(t.device_mesh.shape)
        coord = tuple(t.device_mesh.get_coordinate() or ())
    else:  # replicated over the EP groups: index of this rank's group
        rest_shape, coord = (), ()
    first = min(dist.get_process_group_ranks(st.group))
    mine = (dist.get_rank(), st.rank, coord, first)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if not rest_shape:
        firsts = sorted({e[3] for e in every})
        rest_shape = (len(firsts),)
        every = [(r, e, (firsts.index(f),), f) for r, e, _c, f in every]
    ranks = torch.full((st.size, *rest_shape), -1, dtype=torch.int64)
    for r, e, c, _f in every:
        ranks[(e, *c)] = r
    if int(ranks.min()) < 0:
        raise RuntimeError(f"EP checkpoint mesh has holes: {ranks.tolist()}")
    names = ("ep", *(f"ep_rest{i}" for i in range(len(rest_shape))))
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False)
    setattr(module, key, mesh)
    return mesh


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
