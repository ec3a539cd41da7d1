"""The multi-process tests' launcher: a function run on N CPU processes joined in one gloo group.

Every multi-process parity test of the workspace goes through `spawn_ranks`: it spawns the
ranks, joins them in a gloo process group (one thread each, a free port), runs the worker and
hands back each rank's JSON result. Workers run many scenarios per spawn; `run_cases` keeps one
failing scenario from hiding the others: its traceback becomes its result.

Ranks start from a fork server (where the platform has one) that imported torch, torch.distributed
and transformers once: a fresh interpreter per rank spends ~5-8 s of CPU on those imports, so a
4-rank spawn on 2 cores took ~19 s before its first line of work, and under a second from the
server (measured on the CI's 2-core machine). Each rank still gets the caller's environment of
the moment (applied before the worker runs) and a fresh process: nothing but imported modules is
shared.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["free_port", "full_grads", "init_gloo", "run_cases", "spawn_ranks"]


def free_port() -> int:
    """A TCP port nothing listens on now (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 240) -> None:
    """Join a `world`-rank gloo group whose store rank 0 serves on `port` (127.0.0.1)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def spawn_ranks(
    worker: Callable[..., dict[str, Any]], world: int, *args: Any, timeout_s: float = 240
) -> list[dict[str, Any]]:
    """Run ``worker(rank, world, *args)`` on `world` spawned processes inside one gloo group and
    return each rank's result (a JSON-serialisable dict), rank 0 first.

    `worker` must be importable by the spawned children (a module-level function). The group
    exists while it runs and is destroyed after (a worker may replace it: whatever group is left
    is destroyed). A worker that raises fails the spawn with its traceback."""
    import torch.multiprocessing as mp

    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="lmms_ranks_") as out:
        mp.start_processes(
            _entry, args=(worker, world, free_port(), out, args, timeout_s, env), nprocs=world,
            join=True, start_method=_start_method(),
        )  # fmt: skip
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


#: what the fork server imports once for every rank it forks (the slow imports of a worker)
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor",
            "torch.distributed.checkpoint", "transformers", "transformers.modeling_utils"]  # fmt: skip


def _start_method() -> str:
    """The ranks' start method: "forkserver" with `_PRELOAD` where the platform has it, else
    "spawn". The server starts with the first spawn of this process and serves every later one."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


def _entry(
    rank: int, worker: Callable[..., dict[str, Any]], world: int, port: int, out: str,
    args: tuple[Any, ...], timeout_s: float, env: dict[str, str],
) -> None:  # fmt: skip
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, port, timeout_s)
    try:
        result = worker(rank, world, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cases(cases: Iterable[tuple[str, Callable[[], Any]]], *, barrier: bool = False) -> dict:
    """``{name: fn()}`` over `cases` in order; a case that raises gets ``{"error": traceback}``
    (also printed, since the other ranks may then wait in a collective) and the rest still run.
    `barrier`: all ranks meet after each case."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for name, fn in cases:
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"rank {dist.get_rank()} {name}:", results[name]["error"], flush=True)
        if barrier:
            dist.barrier()
    return results


def full_grads(model: Any, *, zeros_for_missing: bool = False) -> dict[str, Any]:
    """Each parameter's gradient by name, whole (a sharded DTensor's gathered: a collective, so
    every rank calls it) and cloned; a parameter without one is left out, or given zeros."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            if zeros_for_missing:
                out[name] = torch.zeros(p.shape, dtype=p.dtype)  # a DTensor's: global
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out
