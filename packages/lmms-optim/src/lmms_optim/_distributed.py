"""Distributed Newton–Schulz for FSDP2 row-sharded (``Shard(0)``) DTensor matrices.

NS of a row shard is not the row shard of NS (``X Xᵀ`` couples all rows), so every matrix is
orthogonalised whole, on one *owner* rank of its shard group:

1. Matrices are sorted by shape and cut into buckets of about ``bucket_numel`` elements; inside
   a bucket each matrix goes to the least-loaded rank (load = NS cost ``m·n·min(m, n)``, carried
   across buckets), so same-shaped matrices spread over ranks and stack into one batched NS.
2. Gather: one ``all_to_all_single`` per bucket sends every rank's bf16 row shards to the owners.
3. Owners run batched NS per (shape, schedule); one ``all_to_all_single`` sends row shards back.
4. Pipelining: the gather of bucket ``k+1`` and the scatter of bucket ``k`` are in flight while
   bucket ``k`` is computed (async collectives).

Tensor-parallel matrices (column/row shards, FSDP2 over TP) are orthogonalised whole on every
rank of their mesh instead (:func:`orthogonalize_full`): exact, at the cost of an all-gather and
redundant NS FLOPs on the TP group.

With a ``(Replicate, Shard(0))`` mesh (HSDP) each replica group does the same work on its own
shard group: gradients are already identical across replicas, so no extra communication is
needed, at the cost of redundant NS FLOPs on the replicas.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["is_tensor_parallel", "orthogonalize_full", "orthogonalize_sharded"]


@dataclass(kw_only=True, slots=True)
class _Item:
    index: int
    update: torch.Tensor  # [rows_local, ...] local shard of the Muon update
    m: int
    n: int
    key: tuple
    rows: list[int]  # rows held by each rank of the shard group
    owner: int = -1
    result: torch.Tensor | None = field(default=None)

    @property
    def cost(self) -> int:
        return self.m * self.n * min(self.m, self.n)


def is_tensor_parallel(p: torch.Tensor) -> bool:
    """A DTensor sharded some other way than FSDP2's rows: a tensor-parallel column/row shard
    (``Shard(1)``, ``_StridedShard``, or rows split over two mesh dims: FSDP2 over TP)."""
    if not (hasattr(p, "_local_tensor") and hasattr(p, "placements")):
        return False
    from torch.distributed.tensor import Replicate, Shard

    plain = [type(pl) is Shard and pl.dim == 0 for pl in p.placements]  # type: ignore[attr-defined]
    other = [not (ok or isinstance(pl, Replicate)) for ok, pl in zip(plain, p.placements)]  # type: ignore[attr-defined]
    return any(other) or sum(plain) > 1


def orthogonalize_full(
    p: torch.Tensor,
    u: torch.Tensor,
    key: tuple,
    ns_fn: Callable[[torch.Tensor, tuple], torch.Tensor],
) -> torch.Tensor:
    """NS of a tensor-parallel matrix as the *whole* matrix (exact: the same result as one
    process): the update's shards are all-gathered (bf16), every rank of the mesh runs the same
    NS, and keeps its own shard of the result (same placements as ``p``)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    shaped = DTensor.from_local(
        u.to(torch.bfloat16), mesh, placements, shape=p.shape, stride=p.stride(), run_check=False
    )
    full = shaped.full_tensor()  # [m, ...]
    m = full.shape[0]
    out = ns_fn(full.reshape(1, m, -1), key)[0].reshape(full.shape)
    whole = DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, placements).to_local()


def _shard_dim(p: torch.Tensor) -> int | None:
    """Mesh dim carrying ``Shard(0)``; None when fully replicated. Raises on anything else."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = []
    for i, pl in enumerate(p.placements):  # type: ignore[attr-defined]
        if type(pl) is Shard and pl.dim == 0:
            shard_dims.append(i)
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(
                f"distributed Muon supports FSDP2/HSDP placements (Shard(0) and Replicate) only; "
                f"got {tuple(p.placements)} for a parameter of shape {tuple(p.shape)}: "  # type: ignore[attr-defined]
                "tensor-parallel (column/row or strided) shards would need NS over the TP "
                "group as well; keep TP-sharded matrices on AdamW"
            )
    if len(shard_dims) > 1:
        raise NotImplementedError(
            f"distributed Muon supports one Shard(0) mesh dim, got {tuple(p.placements)}"  # type: ignore[attr-defined]
        )
    return shard_dims[0] if shard_dims else None


def orthogonalize_sharded(
    entries: list[tuple[torch.Tensor, torch.Tensor, tuple]],
    *,
    ns_fn: Callable[[torch.Tensor, tuple], torch.Tensor],
    bucket_numel: int,
) -> list[torch.Tensor]:
    """``entries``: (DTensor param, local update shard, ns key). Returns local result shards."""
    results: list[torch.Tensor | None] = [None] * len(entries)
    per_group: dict[int, tuple[dist.ProcessGroup, int, int, list[_Item]]] = {}
    for i, (p, u, key) in enumerate(entries):
        if is_tensor_parallel(p):
            results[i] = orthogonalize_full(p, u, key, ns_fn)
            continue
        sd = _shard_dim(p)
        m, n = p.shape[0], math.prod(p.shape[1:])
        mesh = p.device_mesh  # type: ignore[attr-defined]
        ws = 1 if sd is None else mesh.size(sd)
        if ws == 1:  # the local tensor is the whole matrix
            results[i] = ns_fn(u.reshape(1, m, n), key)[0].view(u.shape)
            continue
        rank = mesh.get_local_rank(sd)
        chunk = -(-m // ws)
        rows = [max(0, min(chunk, m - r * chunk)) for r in range(ws)]
        if u.shape[0] != rows[rank]:
            raise RuntimeError(
                f"local shard has {u.shape[0]} rows, expected {rows[rank]} (torch.chunk layout "
                f"of {m} rows over {ws} ranks); padded or uneven layouts are not supported"
            )
        pg = mesh.get_group(sd)
        entry = per_group.setdefault(id(pg), (pg, ws, rank, []))
        entry[3].append(_Item(index=i, update=u, m=m, n=n, key=key, rows=rows))
    for pg, ws, rank, items in per_group.values():
        _run_group(items, pg, ws, rank, ns_fn, bucket_numel)
        for it in items:
            results[it.index] = it.result
    return results  # type: ignore[return-value]


def _buckets(items: list[_Item], ws: int, bucket_numel: int) -> list[list[_Item]]:
    order = sorted(items, key=lambda it: (-it.m * it.n, it.m, it.n, it.index))
    buckets: list[list[_Item]] = [[]]
    size = 0
    for it in order:
        if buckets[-1] and size >= bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(it)
        size += it.m * it.n
    load = [0] * ws
    for b in buckets:
        for it in sorted(b, key=lambda it: (-it.cost, it.index)):
            it.owner = min(range(ws), key=lambda r: (load[r], r))
            load[it.owner] += it.cost
    return buckets


def _start_gather(bucket: list[_Item], pg, ws: int, rank: int):
    by_owner = [[it for it in bucket if it.owner == r] for r in range(ws)]
    send_parts = [it.update.reshape(-1).to(torch.bfloat16) for r in range(ws) for it in by_owner[r]]
    dev = bucket[0].update.device
    send = torch.cat(send_parts) if send_parts else torch.empty(0, device=dev)
    in_splits = [sum(it.rows[rank] * it.n for it in by_owner[r]) for r in range(ws)]
    mine = by_owner[rank]
    out_splits = [sum(it.rows[r] * it.n for it in mine) for r in range(ws)]
    recv = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=dev)
    work = dist.all_to_all_single(
        recv, send.to(torch.bfloat16), out_splits, in_splits, group=pg, async_op=True
    )
    return work, recv, send


def _compute(bucket: list[_Item], recv: torch.Tensor, ws: int, rank: int, ns_fn) -> list[_Item]:
    """Rebuild owned full matrices from the received shards, batched NS; returns owned items."""
    mine = [it for it in bucket if it.owner == rank]
    full = {
        it.index: torch.empty(it.m, it.n, dtype=torch.bfloat16, device=recv.device) for it in mine
    }
    off = 0
    for src in range(ws):
        for it in mine:
            r = it.rows[src]
            start = sum(it.rows[:src])
            full[it.index][start : start + r].copy_(recv[off : off + r * it.n].view(r, it.n))
            off += r * it.n
    groups: dict[tuple, list[_Item]] = defaultdict(list)
    for it in mine:
        groups[(it.m, it.n, it.key)].append(it)
    for (_, _, key), its in groups.items():
        out = ns_fn(torch.stack([full[it.index] for it in its]), key)  # [B, m, n]
        for j, it in enumerate(its):
            it.result = out[j]
    return mine


def _start_scatter(bucket: list[_Item], mine: list[_Item], pg, ws: int, rank: int):
    dev = bucket[0].update.device
    parts = []
    for dst in range(ws):
        for it in mine:
            start = sum(it.rows[:dst])
            parts.append(it.result[start : start + it.rows[dst]].reshape(-1))  # type: ignore[index]
    send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.bfloat16, device=dev)
    in_splits = [sum(it.rows[dst] * it.n for it in mine) for dst in range(ws)]
    out_splits = [sum(it.rows[rank] * it.n for it in bucket if it.owner == r) for r in range(ws)]
    recv = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=dev)
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=pg, async_op=True)
    return work, recv, send


def _finish_scatter(bucket: list[_Item], recv: torch.Tensor, ws: int, rank: int) -> None:
    off = 0
    for src in range(ws):
        for it in bucket:
            if it.owner != src:
                continue
            k = it.rows[rank] * it.n
            it.result = recv[off : off + k].view(it.update.shape)
            off += k


def _run_group(items, pg, ws, rank, ns_fn, bucket_numel) -> None:
    buckets = _buckets(items, ws, bucket_numel)
    gathers = [None] * len(buckets)
    scatters = []
    gathers[0] = _start_gather(buckets[0], pg, ws, rank)
    for k, bucket in enumerate(buckets):
        if k + 1 < len(buckets):  # next bucket's traffic overlaps this bucket's NS
            gathers[k + 1] = _start_gather(buckets[k + 1], pg, ws, rank)
        work, recv, _send = gathers[k]  # type: ignore[misc]
        work.wait()
        gathers[k] = None
        mine = _compute(bucket, recv, ws, rank, ns_fn)
        scatters.append((bucket, *_start_scatter(bucket, mine, pg, ws, rank)))
    for bucket, work, recv, _send in scatters:
        work.wait()
        _finish_scatter(bucket, recv, ws, rank)
