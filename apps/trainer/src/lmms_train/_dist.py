"""Process-group set-up and the few collectives the loop needs.

One process (no torchrun) runs without a process group and without FSDP: the model is a plain
module and bf16 uses autocast. Under torchrun every rank joins one group (NCCL on CUDA, gloo on
CPU) and the model is sharded with FSDP2 over the data-parallel x sequence-parallel ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lmms_train._errors import ConfigError

__all__ = ["DistEnv", "init_distributed"]


@dataclass(kw_only=True, slots=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sp: int = 1  # Ulysses degree: ranks sharing one packed row
    dp_replicate: int = 1
    mesh: Any = None  # DeviceMesh from lmms_parallel when world_size > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (each reads different data)."""
        return self.world_size // self.sp

    @property
    def dp_rank(self) -> int:
        """Rank among the data-parallel ranks (SP is the innermost mesh dimension)."""
        return self.rank // self.sp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Reduce a few scalars over all ranks in float64 (exact for counts < 2**53)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer_args.device: cuda, but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(*, device: str, sp: int, dp_replicate: int, fsdp: bool) -> DistEnv:
    """Read torchrun's environment, check the parallel degrees, join the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world % (sp * dp_replicate) != 0:
        raise ConfigError(
            f"world size {world} is not divisible by sp_ulysses_degree ({sp}) x dp_replicate "
            f"({dp_replicate}) = {sp * dp_replicate}; launch a multiple of it"
        )
    if world > 1 and not fsdp:
        raise ConfigError("trainer_args.fsdp: false is only supported on one process")
    dev = _pick_device(device, local_rank)
    env = DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=dev,
        sp=sp,
        dp_replicate=dp_replicate,
    )
    if world > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group(backend, timeout=timedelta(minutes=30), **kwargs)
    return env
