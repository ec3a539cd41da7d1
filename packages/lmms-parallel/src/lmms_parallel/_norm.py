"""Global gradient norm over parameters that live on different meshes (FSDP2, TP, EP).

``torch.nn.utils.clip_grad_norm_`` reduces DTensor norms over each tensor's own mesh and cannot
mix meshes; under expert parallelism a rank's experts are not even a shard of one DTensor (each EP
rank holds other experts). Here every rank sums the squares of the gradient elements it holds,
each parameter's sum divided by how many ranks hold the same elements (the replicas: the world
over the number of distinct shards), and one all-reduce over the world gives the squared norm of
the whole model's gradient, the same number on every rank and the same as one process's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["clip_grad_norm_"]


def _replicas(p: torch.Tensor, world: int, ep_size: int) -> int:
    shards = ep_size
    if hasattr(p, "placements"):
        from torch.distributed.tensor import Replicate

        mesh = p.device_mesh  # type: ignore[attr-defined]
        for i, pl in enumerate(p.placements):  # type: ignore[attr-defined]
            if not isinstance(pl, Replicate):
                shards *= mesh.size(i)
    if world % shards:
        raise RuntimeError(f"a parameter has {shards} shards over a world of {world}")
    return world // shards


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, *, model: nn.Module | None = None
) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``
    (``0`` or ``inf``: measure only); returns the global norm (fp32 scalar on the gradients'
    device).

    ``model``: where the ``experts`` EP style left its marks (its expert parameters hold other
    experts on every EP rank). Collective over the default group."""
    from ._ep import ep_params

    ep_size = {}
    if model is not None:
        ep_size = {id(getattr(m, name)): st.size for _f, m, name, st in ep_params(model)}
    params = [p for p in params if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    grads = []
    for p in params:
        g = p.grad
        local = g._local_tensor if hasattr(g, "_local_tensor") else g  # type: ignore[union-attr]
        grads.append(local)
        total = total + local.float().pow(2).sum() / _replicas(p, world, ep_size.get(id(p), 1))
    if world > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm > 0 and math.isfinite(max_norm) and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
    return norm
