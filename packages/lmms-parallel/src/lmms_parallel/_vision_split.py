"""Vision work split across the ranks of a sequence-parallel group.

Under Ulysses SP every rank of the group holds the same pack. Without a split each of them runs
the whole vision tower on every image and frame of it: the most expensive part of a video step,
repeated ``sp`` times. Here each rank encodes a contiguous share of the pack's vision items
(images, video frames, tiles), chosen so that the largest share's FLOPs are as small as possible
(:func:`split_contiguous`), and the tower's outputs are all-gathered (:func:`gather_rows`) so
that every rank merges the whole row as before; its Ulysses slice then takes what it needs.

Contiguous shares keep the gathered rows in the pack's order (a plain concatenation in rank
order) and keep each rank's tower call one ordinary call on a sub-grid. Gathering every feature
instead of only the rows of each rank's slice costs one ``N x H`` buffer per rank (N vision tokens,
far below the attention activations of the decoder) and leaves the multimodal merge untouched.

Model-agnostic: :class:`lmms_parallel.SplitVision` hooks the tower with these; the model side
(a ``VisionSplitPlan``) says what an item is and how to call the tower on a range of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["gather_rows", "split_contiguous", "split_imbalance"]


def split_contiguous(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Cut ``costs`` (items in order) into ``parts`` contiguous ranges ``[lo, hi)`` whose largest
    total is as small as possible (ranges may be empty when items are fewer than parts).

    Bisection on the bound with a greedy feasibility check (``O(n log(sum/eps))``); the ranges
    are then filled greedily up to the optimal bound, later ranges first, leaving at least one
    item for each range in front while there are enough (empty shares only when items are fewer
    than parts, and then on the first ranks). Exact optimum up to ``1e-9`` relative.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    n = len(costs)
    if n == 0:
        return [(0, 0)] * parts
    if any(c < 0 for c in costs):
        raise ValueError("costs must be non-negative")

    def needed(bound: float) -> int:
        count, acc = 1, 0.0
        for c in costs:
            if acc + c > bound and acc > 0:
                count, acc = count + 1, 0.0
            acc += c
        return count

    lo, hi = max(costs), float(sum(costs))
    for _ in range(200):
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        if needed(mid) <= parts:
            hi = mid
        else:
            lo = mid
    bound = hi * (1 + 1e-12)
    ranges: list[tuple[int, int]] = []
    end, acc = n, 0.0
    for i in range(n - 1, -1, -1):  # fill from the back
        left = parts - len(ranges) - 1  # ranges still to fill in front of the current one
        if acc > 0 and (acc + costs[i] > bound or i + 1 <= left):
            ranges.append((i + 1, end))
            end, acc = i + 1, 0.0
        acc += costs[i]
    ranges.append((0, end))
    ranges += [(0, 0)] * (parts - len(ranges))
    return ranges[::-1]


def split_imbalance(costs: Sequence[float], ranges: Sequence[tuple[int, int]]) -> float:
    """Largest share over the mean share (1.0 = perfectly balanced; 0 items: 1.0)."""
    shares = [sum(costs[lo:hi]) for lo, hi in ranges]
    mean = sum(shares) / len(shares)
    return max(shares) / mean if mean > 0 else 1.0


class _GatherRows(torch.autograd.Function):
    """All-gather of variable row counts; backward: each rank's rows get the sum over ranks of
    their gradients (every rank used the gathered rows only for its own sequence slice)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(counts)
        pad = local.new_zeros((width - local.shape[0], *local.shape[1:]))
        buf = torch.cat([local, pad]) if pad.shape[0] else local.contiguous()
        parts = [torch.empty_like(buf) for _ in counts]
        dist.all_gather(parts, buf, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def gather_rows(local: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``local [counts[rank], ...]`` from every rank of ``group``, concatenated in rank order:
    ``[sum(counts), ...]`` on every rank (``counts`` known to all ranks, e.g. from the host
    grids). Differentiable: the gradient of a rank's rows is summed over the group."""
    rank = dist.get_rank(group)
    if local.shape[0] != counts[rank]:
        raise ValueError(f"rank {rank} holds {local.shape[0]} rows, counts say {counts[rank]}")
    return _GatherRows.apply(local, list(counts), rank, group)
