"""Expert parallelism for transformers' 3-D experts modules, applied from outside.

An experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; forward
``(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``) becomes, on each rank of
an EP group of size ``ep``, the holder of experts ``[r·E/ep, (r+1)·E/ep)``: its 3-D parameters are
replaced by their local slice (on the meta device too) and its forward by a dispatch around the
module's *own* forward:

1. sort this rank's ``N·k`` (token, expert) pairs by expert and count them per expert;
2. exchange the counts (one small all-to-all), read the splits on the host (one read per layer;
   an all-to-all with uneven splits needs them), send the rows to the experts' ranks
   (``all_to_all_single`` with autograd);
3. regroup the received rows by local expert and run the module's class forward on them with
   ``top_k = 1`` and unit weights (whatever experts implementation the config selects: lmms'
   grouped GEMMs, upstream's loop, ...) with ``num_experts`` set to the local count;
4. send the results back (the reverse all-to-all), weight them by the router and sum over ``k``.

Routing is dropless (no capacity): a rank receives whatever its experts were chosen for, from
zero rows up. A rank whose experts receive no row still takes part in every collective and puts
its expert parameters in the graph (zero gradients), so FSDP's reduce-scatters stay in step.

Gradients: the expert parameters of rank ``r`` see the rows of every rank of the EP group (the
all-to-all's backward brings their gradients home), so what remains is the sum over the ranks that
hold the *same* experts (the data-parallel ranks outside the EP group): FSDP2 over
``expert_fsdp_mesh`` (see :func:`lmms_parallel.expert_meshes`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertParallel", "ep_local_slice"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(kw_only=True, slots=True)
class _EPState:
    group: dist.ProcessGroup
    size: int
    rank: int
    n_experts: int  # global
    n_local: int
    params: tuple[str, ...]


def ep_local_slice(n_experts: int, ep: int, rank: int) -> slice:
    """The experts of EP rank ``rank`` (contiguous blocks of ``n_experts / ep``)."""
    if n_experts % ep:
        raise ValueError(f"ep degree {ep} must divide the number of experts {n_experts}")
    n = n_experts // ep
    return slice(rank * n, (rank + 1) * n)


def _counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows per expert ``[n]`` int64 without a host read."""
    out = torch.zeros(n, dtype=torch.int64, device=ids.device)
    return out.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


class ExpertParallel:
    """EP style for one experts module (``"experts"`` in a spec's ``ep_plan``).

    ``params``: the 3-D parameters sliced on dim 0 (transformers' names by default).
    """

    def __init__(self, group: dist.ProcessGroup, *, params: tuple[str, ...] = EXPERT_PARAMS):
        self.group = group
        self.params = params

    def apply(self, module: nn.Module) -> nn.Module:
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        first = getattr(module, self.params[0], None)
        if not isinstance(first, torch.Tensor) or first.ndim != 3:
            raise TypeError(
                f"{type(module).__name__} has no 3-D {self.params[0]!r}: the 'experts' EP style "
                "wants transformers' fused experts layout ([E, ...] parameters)"
            )
        n_experts = first.shape[0]
        local = ep_local_slice(n_experts, size, rank)
        for name in self.params:
            p = getattr(module, name)
            if p.shape[0] != n_experts:
                raise ValueError(f"{name}: {p.shape[0]} experts, {self.params[0]} {n_experts}")
            data = p.detach()[local]
            data = data if data.device.type == "meta" else data.clone()
            setattr(module, name, nn.Parameter(data, requires_grad=p.requires_grad))
        module._lmms_ep = _EPState(  # type: ignore[attr-defined]
            group=self.group,
            size=size,
            rank=rank,
            n_experts=n_experts,
            n_local=n_experts // size,
            params=self.params,
        )
        module.forward = types.MethodType(_ep_forward, module)  # type: ignore[method-assign]
        return module


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return out.wait() if hasattr(out, "wait") else out  # AsyncCollectiveTensor


def _local_compute(module: nn.Module, st: _EPState, x: torch.Tensor, ids: torch.Tensor):
    """The module's own (class) forward on rows of local experts ``ids [M]``, unit weights."""
    ones = torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device)
    saved = getattr(module, "num_experts", None)
    if saved is not None:
        module.num_experts = st.n_local
    try:
        y = type(module).forward(module, x, ids[:, None], ones)  # [M, H]
    finally:
        if saved is not None:
            module.num_experts = saved
    if x.shape[0] == 0:  # no row here: keep the experts in the graph (zero gradients)
        y = y + sum(getattr(module, n).sum() for n in st.params) * 0.0
    return y


def _ep_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,  # [N, H]
    top_k_index: torch.Tensor,  # [N, k] global expert ids
    top_k_weights: torch.Tensor,  # [N, k]
) -> torch.Tensor:
    st: _EPState = self._lmms_ep  # type: ignore[assignment]
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # [N*k]
    order = torch.argsort(flat, stable=True)
    counts = _counts(flat, st.n_experts)  # [E]: rows this rank sends to each expert
    recv_counts = torch.empty_like(counts)  # [ep * E_local]: rows each source sends to mine
    dist.all_to_all_single(recv_counts, counts, group=st.group)
    both = torch.stack([counts, recv_counts]).view(2, st.size, st.n_local).sum(2).tolist()
    send_splits, recv_splits = both  # host: one read per layer
    rows = hidden_states[order // k]  # [N*k, H] grouped by expert, so by destination rank
    recv = _a2a(rows, recv_splits, send_splits, st.group)  # [M, H]
    # received: per source rank, rows of local expert 0, 1, ... -> regroup by local expert
    local_ids = torch.arange(st.n_local, device=flat.device).repeat(st.size)  # [ep*E_local]
    local_ids = local_ids.repeat_interleave(recv_counts, output_size=sum(recv_splits))  # [M]
    perm = torch.argsort(local_ids, stable=True)
    y = _local_compute(self, st, recv[perm], local_ids[perm])  # [M, H]
    y = torch.empty_like(y).index_copy(0, perm, y)  # back in received order
    out = _a2a(y, send_splits, recv_splits, st.group)  # [N*k, H] in `order`
    weights = top_k_weights.reshape(-1)[order].to(out.dtype)  # [N*k]
    back = torch.empty_like(out).index_copy(0, order, out * weights[:, None])
    return back.view(n, k, -1).sum(1).to(hidden_states.dtype)  # [N, H]


def ep_params(model: nn.Module) -> list[tuple[str, nn.Module, str, _EPState]]:
    """``(full name, module, parameter name, EP state)`` of every expert-parallel parameter."""
    out = []
    for mod_name, module in model.named_modules():
        st = getattr(module, "_lmms_ep", None)
        if st is None:
            continue
        for pname in st.params:
            out.append((f"{mod_name}.{pname}" if mod_name else pname, module, pname, st))
    return out


def load_ep_params(model: nn.Module, full: dict[str, torch.Tensor], *, strict: bool) -> None:
    """Load the expert-parallel parameters of ``model`` from the full weights of rank 0.

    Collective over the default group: rank 0 broadcasts each full ``[E, ...]`` tensor (popped
    from ``full``), every rank copies its experts' slice into its parameter (its FSDP2 shard of
    that slice when the experts are sharded further)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    rank0 = dist.get_rank() == 0
    for fqn, module, pname, st in ep_params(model):
        p = getattr(module, pname)
        shape = (st.n_experts, *p.shape[1:])
        present = torch.tensor([1 if (not rank0 or fqn in full) else 0])
        dist.broadcast(present, src=0)
        if not int(present):
            if strict:
                raise KeyError(f"{fqn} is missing from the weights")
            continue
        dev = p.device
        if dev.type == "meta":
            raise RuntimeError(f"{fqn} is on the meta device: call materialize() before loading")
        if rank0:
            value = full.pop(fqn).to(dev, p.dtype).contiguous()
            if tuple(value.shape) != shape:
                raise ValueError(f"{fqn}: weights have {tuple(value.shape)}, model {shape}")
        else:
            value = torch.empty(shape, dtype=p.dtype, device=dev)
        dist.broadcast(value, src=0)
        local = value[ep_local_slice(st.n_experts, st.size, st.rank)]
        with torch.no_grad():
            if isinstance(p, DTensor):
                shard = distribute_tensor(local, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(local)
