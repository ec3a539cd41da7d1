"""Ulysses sequence parallelism for BAGEL rows.

The span masks are pairwise over a whole sample, and Ulysses keeps them whole: every rank embeds
the full row (text, ViT, latents: the towers' work is repeated, not split), keeps its contiguous
``ceil(T / sp)`` slice of tokens for the decoder (MoT routing, norms and MLPs are per token), and
around attention swaps tokens for heads with two all-to-alls, so each rank attends over *all*
tokens of the row for ``H / sp`` query heads and ``KV / sp`` key/value heads under the unchanged
span mask. The final hidden states are gathered (gradients summed over the group) and the heads
read the whole row on every rank; the objective scales its gradient by ``1 / sp`` so the group's
summed gradients equal one process's. Needs ``num_key_value_heads % sp == 0``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._mask import PackLayout, span_attention

__all__ = ["sp_gather", "sp_layout", "sp_slice", "sp_span_attention"]


def sp_layout(layout: PackLayout, group: Any, total: int) -> PackLayout:
    """A shallow copy of ``layout`` that tells attention to run Ulysses over ``group``."""
    out = copy.copy(layout)
    out.sp_group, out.sp_total = group, total  # type: ignore[attr-defined]
    return out


def _chunk(total: int, sp: int) -> int:
    return -(-total // sp)


def sp_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous slice ``[ceil(T/sp), ...]`` of ``x [T, ...]`` (zero padded)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = _chunk(x.shape[0], sp)
    pad = c * sp - x.shape[0]
    if pad:
        x = F.pad(x, [0, 0] * (x.dim() - 1) + [0, pad])
    return x[rank * c : (rank + 1) * c]


def sp_gather(x: torch.Tensor, group: Any, total: int) -> torch.Tensor:
    """The whole row ``[T, ...]`` from every rank's slice (gradients summed over the group)."""
    from lmms_parallel import gather_rows

    sp = dist.get_world_size(group)
    return gather_rows(x, [x.shape[0]] * sp, group)[:total]


def sp_span_attention(
    q: torch.Tensor,  # [T/sp, H, D] local tokens
    k: torch.Tensor,  # [T/sp, KV, D]
    v: torch.Tensor,
    layout: PackLayout,
) -> torch.Tensor:  # [T/sp, H, D]
    from lmms_parallel import all_to_all_heads_to_seq, all_to_all_seq_to_heads

    group, total = layout.sp_group, layout.sp_total  # type: ignore[attr-defined]
    if k.shape[1] % dist.get_world_size(group):
        raise NotImplementedError(
            f"bagel SP: {k.shape[1]} key/value heads do not split over sp={dist.get_world_size(group)}"
        )
    qh, kh, vh = (all_to_all_seq_to_heads(t, group)[:total] for t in (q, k, v))  # [T, H/sp, D]
    out = span_attention(qh, kh, vh, layout)
    pad = q.shape[0] * dist.get_world_size(group) - total
    if pad:
        out = F.pad(out, [0, 0, 0, 0, 0, pad])
    return all_to_all_heads_to_seq(out, group)
