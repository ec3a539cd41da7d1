"""Ulysses sequence parallelism over a decoder stack that takes one packed row ``[T, ...]``.

For a model whose attention rule is pairwise over a whole sample (a mask that a per-rank key/value
shard cannot honour, e.g. BAGEL's span masks), Ulysses keeps every sample whole: every rank embeds
the full row, then two sequence-parallel plan styles (:func:`lmms_parallel.apply_sp`, sharing one
context for the row length)

* ``sp_row_stack`` (on the decoder stack) slices every tensor argument of the stack whose first
  dimension is the row length ``T`` (hidden states, per-token flags, RoPE tables) to this rank's
  contiguous ``ceil(T / sp)`` chunk (zero padded) before the stack runs (a forward pre-hook), and
  gathers its output back to the whole row ``[T, ...]`` (gradients summed over the group);
* ``sp_row_attention`` (on each attention module) swaps tokens for heads with two all-to-alls
  around each attention call, so the unchanged attention function sees *all* ``T`` tokens for
  ``H / sp`` query heads and ``KV / sp`` key/value heads (the module's ``attend`` attribute is
  wrapped on the instance).

The model stays single-device: it calls ``self.attend(q, k, v, *rest)`` with ``q [T, H, D]``,
``k, v [T, KV, D]`` and a stack module ``stack(x [T, ...], ...) -> [T, ...]``; this module owns the
process group. Needs ``KV % sp == 0``. The heads read the whole row on every rank; the loss's
gradient is divided by ``sp`` (:func:`lmms_parallel.sp_replicated_grad`) so the group's summed
gradients equal one process's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._plans import register_style
from ._ulysses import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from ._vision_split import gather_rows

__all__ = ["gather_row_slices", "slice_row"]


def _chunk(total: int, sp: int) -> int:
    return -(-total // sp)


def slice_row(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous slice ``[ceil(T/sp), ...]`` of ``x [T, ...]`` (zero padded)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = _chunk(x.shape[0], sp)
    pad = c * sp - x.shape[0]
    if pad:
        x = F.pad(x, [0, 0] * (x.dim() - 1) + [0, pad])
    return x[rank * c : (rank + 1) * c]


def gather_row_slices(x: torch.Tensor, group: Any, total: int) -> torch.Tensor:
    """The whole row ``[T, ...]`` from every rank's slice (gradients summed over the group)."""
    sp = dist.get_world_size(group)
    return gather_rows(x, [x.shape[0]] * sp, group)[:total]


def _slice_arg(a: Any, group: Any, total: int) -> Any:
    if torch.is_tensor(a) and a.dim() and a.shape[0] == total:
        return slice_row(a, group)
    if isinstance(a, tuple):
        return tuple(_slice_arg(t, group, total) for t in a)
    return a


class _RowStack:
    """``sp_row_stack`` (the decoder stack ``stack(x [T, ...], *args) -> [T, ...]``): its tensor
    arguments of length ``T`` sliced to this rank's chunk, its output gathered to the whole row;
    records ``T`` in the shared context for ``sp_row_attention``."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def apply(self, module: nn.Module) -> list[Callable[[], Any]]:
        ctx = self.ctx

        def pre(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            ctx.total = int(args[0].shape[0])
            return tuple(_slice_arg(a, ctx.group, ctx.total) for a in args)

        def post(_mod: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            return gather_row_slices(out, ctx.group, ctx.total)

        hooks = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return [h.remove for h in hooks]


class _RowAttention:
    """``sp_row_attention`` (a module calling ``self.attend(q [T, H, D], k, v [T, KV, D], *rest)``):
    ``attend`` wrapped on the instance with the two all-to-alls (tokens for heads and back)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def apply(self, module: nn.Module) -> list[Callable[[], Any]]:
        ctx, attend = self.ctx, module.attend
        own = "attend" in module.__dict__

        def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> torch.Tensor:
            group, total, sp = ctx.group, ctx.total, ctx.size
            if k.shape[1] % sp:
                raise NotImplementedError(
                    f"row SP: {k.shape[1]} key/value heads do not split over sp={sp}"
                )
            # [T/sp, H, D] local tokens -> [T, H/sp, D] all tokens of local heads
            qh, kh, vh = (all_to_all_seq_to_heads(t, group)[:total] for t in (q, k, v))
            out = attend(qh, kh, vh, *rest)
            pad = q.shape[0] * sp - total
            if pad:
                out = F.pad(out, [0, 0, 0, 0, 0, pad])
            return all_to_all_heads_to_seq(out, group)

        module.attend = ulysses

        def undo() -> None:
            if own:
                module.attend = attend
            else:
                del module.__dict__["attend"]

        return [undo]


register_style("sp", "sp_row_stack")(_RowStack)
register_style("sp", "sp_row_attention")(_RowAttention)
