"""Shared helpers for the lmms-kernels tests: random packings and a dense masked reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_cu_seqlens(total: int, n_max: int, gen: torch.Generator) -> torch.Tensor:
    """Random segment boundaries covering [0, total] with 1..n_max segments (all non-empty)."""
    n = int(torch.randint(1, min(n_max, total) + 1, (1,), generator=gen))
    cuts = torch.randperm(total - 1, generator=gen)[: n - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([total])]).to(torch.int32)


def dense_reference(
    q, k, v, cu_q, cu_k, *, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """Full [T, T] block-diagonal (optionally causal, bottom-right aligned) masked attention."""
    tq, tk = q.shape[0], k.shape[0]
    doc_q = torch.searchsorted(cu_q[1:].long(), torch.arange(tq), right=True)
    doc_k = torch.searchsorted(cu_k[1:].long(), torch.arange(tk), right=True)
    mask = doc_q[:, None] == doc_k[None, :]
    if causal:
        rel_q = torch.arange(tq) - cu_q.long()[doc_q]
        rel_k = torch.arange(tk) - cu_k.long()[doc_k]
        len_q, len_k = torch.diff(cu_q.long())[doc_q], torch.diff(cu_k.long())[doc_q]
        mask &= rel_k[None, :] <= (rel_q + len_k - len_q)[:, None]
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        kk.transpose(0, 1).float(),
        vv.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)
