"""A counter-based random source for stochastic objectives: values are a pure function of
``(seed, step, the sample's tokens, the position in the sample)``.

Why not a ``torch.Generator`` whose state is checkpointed: a generator's draws depend on the
order and the place samples are met (which rank, which micro-batch, where in the pack), so the
same sample would get another mask under FSDP on 2 ranks than in one process, under SP than
without, packed than unpacked. A counter-based draw keyed on the sample itself gives every sample
the same noise level and mask in every layout, and a resumed run (same seed, same step, the same
data order restored by the loader) redraws them bit for bit with no state to save.

The hash is a 31-bit multiply-xorshift ("lowbias32"-style constants reduced to keep every product
below 2**62, so int64 arithmetic never overflows on any device). Uniforms have 31 random bits,
ample for masks and noise levels. Two identical samples in one step get the same draw: keys are
content hashes by design (documented in docs/objectives.md).
"""

from __future__ import annotations

import torch

__all__ = ["mix31", "sample_keys", "segment_ids", "uniform31"]

_M31 = (1 << 31) - 1
_C1 = 0x21F0AAAD & _M31  # odd multipliers < 2**31
_C2 = 0x735A2D97 & _M31
_GOLD = 0x1E3779B9  # position / stream offset


def mix31(x: torch.Tensor) -> torch.Tensor:
    """Hash int64 values in ``[0, 2**31)`` to ``[0, 2**31)`` (elementwise, any device)."""
    x = x & _M31
    x = x ^ (x >> 16)
    x = (x * _C1) & _M31
    x = x ^ (x >> 15)
    x = (x * _C2) & _M31
    return x ^ (x >> 15)


def uniform31(x: torch.Tensor) -> torch.Tensor:
    """Hashed int64 ``x`` to float64 uniforms in ``(0, 1)``."""
    return (mix31(x).double() + 0.5) / float(1 << 31)


def segment_ids(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[T]`` int64: the index of each token's segment (no host synchronisation)."""
    pos = torch.arange(n_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), pos, right=True)


def sample_keys(
    input_ids: torch.Tensor,  # [T] int64
    cu_seqlens: torch.Tensor,  # [n+1] int32
    *,
    seed: int,
    step: int,
    stream: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment keys from the segment's tokens, the seed, the step and a stream id.

    Returns ``(keys [n] int64 in [0, 2**31), seg [T] segment of each token, pos [T] position of
    each token in its segment)``. A key depends on the whole token sequence of its segment (each
    token hashed with its position, summed mod 2**31), not on where the segment sits in the row.
    """
    ids = input_ids.reshape(-1).long()
    n_tok, n_seg = ids.numel(), cu_seqlens.numel() - 1
    seg = segment_ids(cu_seqlens, n_tok)  # [T]
    pos = torch.arange(n_tok, device=ids.device) - cu_seqlens.long()[seg]  # [T]
    per_tok = mix31(mix31(ids) ^ mix31(pos + _GOLD))  # [T]
    sums = torch.zeros(n_seg, dtype=torch.int64, device=ids.device).index_add_(0, seg, per_tok)
    base = int(mix31(torch.tensor((seed * 1000003 + step * 7919 + stream) & _M31)))
    keys = mix31((sums & _M31) ^ base)  # [n]
    return keys, seg, pos
