"""Process-group set-up and the few collectives the loop needs.

Several processes join a process group (NCCL on CUDA, gloo on CPU) and the model goes through
FSDP2, so bf16 compute comes from FSDP2's MixedPrecisionPolicy (bf16 parameters, fp32 master
weights and gradient reduction). One process (`trainer_args.fsdp` unset or false) skips FSDP2,
whose all-gathers and reduce-scatters are copies on one rank: the module itself computes in bf16
and the optimizer steps fp32 masters (`lmms_parallel.MasterWeights`: the same arithmetic, bit
for bit; +8% tok/s for Qwen2.5-3B on an H200, benchmarks/RESULTS.md); without bf16 it is a plain
fp32 module. `fsdp: true` on one process (needed for `fsdp_cpu_offload`) gets a 1-rank group over
an in-process `HashStore` (no env vars, no port) and runs the FSDP2 path of torchrun.

`distributed` means several ranks: the scalar all-reduces and the vision-tower participation
hook are skipped on one rank, group or not. Host scalars (token counts, timings) are reduced over
a gloo group on the CPU, so reducing them never waits for the device's queue; the step's loss is
reduced on the device (`all_reduce_device_`), asynchronously.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lmms_train._errors import ConfigError

__all__ = ["DistEnv", "default_allocator_conf", "default_kernel_cache", "init_distributed"]

# Variables torch reads its CUDA caching-allocator settings from (the first is the newer name).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@dataclass(kw_only=True, slots=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sp: int = 1  # Ulysses degree: ranks sharing one packed row
    tp: int = 1  # tensor-parallel degree: ranks computing one packed row together
    ep: int = 1  # expert-parallel degree (borrows data-parallel ranks: they read different packs)
    dp_replicate: int = 1
    fsdp: bool = False  # the model is sharded with FSDP2 (a process group and mesh exist)
    owns_group: bool = False  # this env initialised the process group (and destroys it)
    mesh: Any = None  # DeviceMesh from lmms_parallel when fsdp
    cpu_group: Any = None  # gloo group for host scalars (None: the default group is gloo)

    @property
    def distributed(self) -> bool:
        """Several ranks (collectives needed); a 1-rank FSDP run is not distributed."""
        return self.world_size > 1

    @property
    def row_share(self) -> int:
        """Ranks that hold the same packs (SP x TP): host sums over all ranks count them this
        many times."""
        return self.sp * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (each reads different data)."""
        return self.world_size // self.row_share

    @property
    def dp_rank(self) -> int:
        """Rank among the data-parallel ranks (SP and TP are the innermost mesh dimensions)."""
        return self.rank // self.row_share

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Reduce a few host scalars over all ranks in float64 (exact for counts < 2**53), on
        the CPU: no device synchronisation."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        dist.all_reduce(t, op=reduce_op, group=self.cpu_group)
        return t.tolist()

    def all_reduce_device_(self, t: torch.Tensor) -> None:
        """Sum a tensor over all ranks in place, on its device (queued, not waited for)."""
        if self.distributed:
            dist.all_reduce(t)

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
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def _pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer_args.device: cuda, but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def default_allocator_conf(environ: dict[str, str] | None = None) -> bool:
    """Turn on the CUDA allocator's expandable segments unless the user configured it.

    Every packed step has different activation shapes, so with fixed-size segments the blocks one
    pack frees rarely fit the next and reserved memory creeps above what is allocated; with
    expandable segments a large pack can use what the last one freed. Read by torch when the
    allocator starts (first CUDA allocation), so this runs before anything touches the device.
    Returns whether it set the variable (False: one of `ALLOC_CONF_VARS` was already set).
    """
    environ = os.environ if environ is None else environ
    if any(var in environ for var in ALLOC_CONF_VARS):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


# flash-attn 4 compiles its CuTe kernels on first use in every process (per head dim, causality,
# direction); with its persistent cache on, later runs on the machine load them from disk instead.
FA4_CACHE_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def default_kernel_cache(environ: dict[str, str] | None = None) -> bool:
    """Turn on flash-attn 4's on-disk kernel cache (its own switch, keyed by its source and
    library versions; directory `FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`, default under the temp dir)
    unless the user set the switch. Read when flash-attn 4 is imported, which lmms-kernels does
    lazily, after this. Returns whether it set the variable."""
    environ = os.environ if environ is None else environ
    if FA4_CACHE_VAR in environ:
        return False
    environ[FA4_CACHE_VAR] = "1"
    return True


def init_distributed(
    *, device: str, sp: int, dp_replicate: int, fsdp: bool | None, tp: int = 1, ep: int = 1
) -> DistEnv:
    """Read torchrun's environment, check the parallel degrees, join the process group.
    `fsdp=None`: FSDP2 on several processes only."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if fsdp is None:
        fsdp = world > 1
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world % (sp * dp_replicate * tp) != 0:
        raise ConfigError(
            f"world size {world} is not divisible by sp_ulysses_degree ({sp}) x dp_replicate "
            f"({dp_replicate}) x tp_degree ({tp}) = {sp * dp_replicate * tp}; launch a multiple "
            "of it"
        )
    if (tp > 1 or ep > 1) and world == 1:
        raise ConfigError("tp_degree / ep_degree > 1 need several processes (torchrun)")
    if world > 1 and not fsdp:
        raise ConfigError("trainer_args.fsdp: false is only supported on one process")
    default_allocator_conf()
    default_kernel_cache()
    dev = _pick_device(device, local_rank)
    env = DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=dev,
        sp=sp,
        tp=tp,
        ep=ep,
        dp_replicate=dp_replicate,
        fsdp=fsdp,
    )
    if (world > 1 or fsdp) and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # One process, not launched by torchrun: a 1-rank group over an in-process store.
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend, timeout=timedelta(minutes=30), **kwargs)
        env.owns_group = True
    if world > 1 and dist.get_backend() != "gloo":
        env.cpu_group = dist.new_group(backend="gloo")  # collective: every rank creates it
    return env
