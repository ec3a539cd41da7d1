"""Ulysses sequence parallelism over a decoder stack that takes one packed row ``[T, ...]``.

For a model whose attention rule is pairwise over a whole sample (a mask that a per-rank key/value
shard cannot honour, e.g. BAGEL's span masks), Ulysses keeps every sample whole: every rank embeds
the full row, :class:`RowSequenceParallel` then

* slices every tensor argument of the stack whose first dimension is the row length ``T``
  (hidden states, per-token flags, RoPE tables) to this rank's contiguous ``ceil(T / sp)`` chunk
  (zero padded) before the stack runs (a forward pre-hook),
* around each attention call swaps tokens for heads with two all-to-alls, so the unchanged
  attention function sees *all* ``T`` tokens for ``H / sp`` query heads and ``KV / sp`` key/value
  heads (the attention modules' ``attend`` attribute is wrapped),
* gathers the stack's output back to the whole row ``[T, ...]`` (gradients summed over the group).

The model stays single-device: it calls ``self.attend(q, k, v, *rest)`` with ``q [T, H, D]``,
``k, v [T, KV, D]`` and a stack module ``stack(x [T, ...], ...) -> [T, ...]``; this module owns the
process group. Needs ``KV % sp == 0``. The heads read the whole row on every rank; the objective
scales its gradient by ``1 / sp`` so the group's summed gradients equal one process's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._ulysses import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from ._vision_split import gather_rows

__all__ = ["RowSequenceParallel", "gather_row_slices", "slice_row"]


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


class RowSequenceParallel:
    """Instance hooks that run ``stack`` (``stack(x [T, ...], *args) -> [T, ...]``) under Ulysses
    SP over ``group``; ``attention`` modules call ``self.attend(q, k, v, *rest)``. ``install()``
    returns ``self``; ``remove()`` undoes it."""

    def __init__(self, stack: nn.Module, attention: Iterable[nn.Module], group: Any) -> None:
        self.stack, self.attention, self.group = stack, list(attention), group
        self.total = 0  # the row length of the running forward (set by the pre-hook)
        self._handles: list[Any] = []
        self._saved: list[tuple[nn.Module, Callable[..., torch.Tensor]]] = []

    def install(self) -> RowSequenceParallel:
        self._handles = [
            self.stack.register_forward_pre_hook(self._pre),
            self.stack.register_forward_hook(self._post),
        ]
        for mod in self.attention:
            self._saved.append((mod, mod.attend))
            mod.attend = self._wrap(mod.attend)
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for mod, fn in self._saved:
            mod.attend = fn
        self._handles, self._saved = [], []

    def _pre(self, _mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.total = int(args[0].shape[0])
        return tuple(_slice_arg(a, self.group, self.total) for a in args)

    def _post(self, _mod: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return gather_row_slices(out, self.group, self.total)

    def _wrap(self, attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> torch.Tensor:
            group, total = self.group, self.total
            sp = dist.get_world_size(group)
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

        return ulysses
