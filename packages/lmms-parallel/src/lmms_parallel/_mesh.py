"""Device mesh from named parallel degrees.

The world is laid out as ``[dp_replicate, dp_shard, sp, tp]`` (row-major, tp innermost so that
tensor-parallel peers are neighbours, i.e. on the same node). Expert parallelism borrows ranks
from ``dp_shard * sp`` (experts are sharded where the dense weights are FSDP-sharded): it does
not add a dimension to the world mesh; :func:`expert_meshes` builds its own
``(dp_replicate, dp_shard*sp / ep, ep)`` mesh over the same ranks (EP peers innermost), whose
``ep`` dim carries the all-to-all and whose other dims shard and reduce the experts (FSDP2).

Gradients are reduced over every rank that saw different tokens: the data-parallel ranks *and*
the sequence-parallel ranks. FSDP2 therefore shards over ``dp_shard * sp`` and replicates over
``dp_replicate`` (HSDP when ``dp_replicate > 1``), see :func:`fsdp_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "ExpertMeshes",
    "ParallelDims",
    "dp_mesh",
    "expert_meshes",
    "fsdp_mesh",
    "sp_group",
    "tp_mesh",
]

_DIMS = ("dp_replicate", "dp_shard", "sp", "tp")


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Named parallel degrees. ``dp_shard=-1`` takes whatever the others leave of the world.

    ``sp`` is the Ulysses sequence-parallel degree (``sp_ulysses_degree`` in the YAML).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    def resolve(self, world_size: int) -> ParallelDims:
        """Return a copy with ``dp_shard`` filled in, or raise saying which product fails."""
        for name in ("dp_replicate", "sp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(
                f"ParallelDims.dp_shard must be >= 1 or -1 (auto), got {self.dp_shard}"
            )
        others = self.dp_replicate * self.sp * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"dp_replicate * sp * tp = {self.dp_replicate} * {self.sp} * {self.tp} = {others} "
                    f"does not divide the world size {world_size}, so dp_shard=-1 cannot be inferred"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise ValueError(
                f"dp_replicate * dp_shard * sp * tp = {self.dp_replicate} * {dp_shard} * {self.sp} * "
                f"{self.tp} = {product} != world size {world_size}"
            )
        if (dp_shard * self.sp) % self.ep:
            raise ValueError(
                f"ep = {self.ep} must divide dp_shard * sp = {dp_shard} * {self.sp} = {dp_shard * self.sp} "
                "(experts are sharded over the FSDP ranks)"
            )
        if self.tp > 1 and self.ep > 1:
            raise NotImplementedError(
                f"tp = {self.tp} with ep = {self.ep}: expert parallelism borrows the data-parallel "
                "ranks and tensor parallelism splits the dense matmuls; combining both (experts "
                "also split by TP) is not implemented: use one of them"
            )
        if self.tp > 1 and self.sp > 1:
            raise NotImplementedError(
                f"tp = {self.tp} with sp_ulysses_degree = {self.sp}: both split the attention "
                "heads; combining them is not implemented: use one of them"
            )
        return ParallelDims(
            dp_replicate=self.dp_replicate, dp_shard=dp_shard, sp=self.sp, tp=self.tp, ep=self.ep
        )

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (distinct batches): ``dp_replicate * dp_shard``."""
        if self.dp_shard < 1:
            raise ValueError("call resolve(world_size) first: dp_shard is still -1")
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str = "cuda", *, world_size: int | None = None) -> DeviceMesh:
        """The 4-D world mesh ``(dp_replicate, dp_shard, sp, tp)``; degrees of 1 are kept.

        Needs an initialised process group. Validates the degrees against the world size first.
        """
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        dims = self.resolve(world_size)
        shape = tuple(getattr(dims, name) for name in _DIMS)
        return init_device_mesh(device_type, shape, mesh_dim_names=_DIMS)


def _ranks(mesh: DeviceMesh) -> torch.Tensor:
    return mesh.mesh  # [dp_replicate, dp_shard, sp, tp] global ranks


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D ``dp_shard*sp``, or 2-D ``(dp_replicate, dp_shard*sp)``."""
    _check_world_mesh(mesh)
    rep, shard, sp, _ = mesh.shape
    if sp == 1:
        return mesh["dp_shard"] if rep == 1 else mesh["dp_replicate", "dp_shard"]
    if rep == 1:
        return mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    # A 2-D sub-mesh mixing a flattened dim is being deprecated upstream: build it explicitly.
    tp = mesh.shape[3]
    if tp != 1:
        raise NotImplementedError("HSDP together with sp > 1 and tp > 1 is not supported yet")
    ranks = _ranks(mesh).reshape(rep, shard * sp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("dp_replicate", "dp_shard_sp"))


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D data-parallel mesh (``dp_replicate * dp_shard``): data loading splits over it."""
    _check_world_mesh(mesh)
    rep = mesh.shape[0]
    return mesh["dp_shard"] if rep == 1 else mesh["dp_replicate", "dp_shard"]._flatten("dp")


def sp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of this rank's sequence-parallel peers."""
    _check_world_mesh(mesh)
    return mesh["sp"].get_group()


def _check_world_mesh(mesh: DeviceMesh) -> None:
    if tuple(mesh.mesh_dim_names or ()) != _DIMS:
        raise ValueError(
            f"expected the mesh of ParallelDims.build_mesh with dims {_DIMS}, got {mesh}"
        )


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D tensor-parallel mesh (``tp``) of the world mesh."""
    _check_world_mesh(mesh)
    return mesh["tp"]


@dataclass(kw_only=True, slots=True)
class ExpertMeshes:
    """Meshes of expert parallelism (see :func:`expert_meshes`)."""

    ep_group: dist.ProcessGroup  # the all-to-all group (EP peers)
    ep_size: int
    fsdp: DeviceMesh  # shards and reduces the experts: 1-D, or 2-D (dp_replicate, ...) for HSDP
    mesh: DeviceMesh  # (dp_replicate, dp_shard_mod_ep, ep)


def expert_meshes(mesh: DeviceMesh, ep: int) -> ExpertMeshes:
    """The EP layout over the world mesh's ranks: ``ep`` consecutive ranks of ``dp_shard * sp``
    exchange tokens; the ranks holding the same experts (``dp_shard * sp / ep`` of them, times
    ``dp_replicate``) shard and reduce them with FSDP2. Collective (every rank calls it)."""
    _check_world_mesh(mesh)
    rep, shard, sp, tp = mesh.shape
    if tp != 1:
        raise NotImplementedError("expert parallelism with tp > 1 is not implemented")
    if (shard * sp) % ep:
        raise ValueError(f"ep = {ep} must divide dp_shard * sp = {shard * sp}")
    ranks = _ranks(mesh).reshape(rep, shard * sp // ep, ep)
    names = ("dp_replicate", "dp_shard_mod_ep", "ep")
    emesh = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=names)
    fsdp = emesh["dp_shard_mod_ep"] if rep == 1 else emesh["dp_replicate", "dp_shard_mod_ep"]
    return ExpertMeshes(ep_group=emesh["ep"].get_group(), ep_size=ep, fsdp=fsdp, mesh=emesh)
