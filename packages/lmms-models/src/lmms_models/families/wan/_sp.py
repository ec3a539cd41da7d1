"""Ulysses sequence parallel for diffusers' ``WanTransformer3DModel``, by instance hooks.

Video tokens are split over the SP ranks after the patch embedding; each block's self-attention
exchanges tokens for heads (lmms_parallel's all-to-all) around the attention core, so every rank
attends over the whole clip with ``heads / sp`` heads; cross-attention (queries: local tokens,
keys: the replicated text) needs no exchange; the last block's output is gathered so the output
norm, projection and unpatchify run on the full clip.

Nothing upstream is copied or patched globally. On each block's ``attn1`` (the self-attention):

* ``norm_q`` / ``norm_k`` (q/k RMSNorm over all heads, so *after* it) and ``to_v`` get forward
  hooks that turn ``[B, N/sp, H*D]`` into ``[B, N, H/sp*D]``, and ``attn1.heads`` is set to
  ``H/sp`` so diffusers' processor unflattens the local heads;
* the 3-D RoPE is applied by the processor to full-length q/k with the *full* rotary table
  (positions of every token are right by construction: frame, row and column come from the
  unsplit latent grid);
* ``to_out[0]`` gets a pre-hook that turns ``[B, N, H/sp*D]`` back into ``[B, N/sp, H*D]``.

Gradients: every SP rank computes the same full loss after the gather. The gather's backward
keeps this rank's slice scaled by ``sp`` and :func:`scale_grad` divides the output's gradient by
``sp``; so block parameters receive the gradient of their own tokens and replicated parameters
(output head, condition embedders) ``1/sp`` of theirs: FSDP's sum over the ``dp_shard x sp`` mesh
gives the single-process gradients. ``WanUlysses.remove()`` restores the module bit for bit.

Why not diffusers' own context parallelism (``enable_parallelism``): it needs an accelerator
(it fails on CPU, so SP 2 == SP 1 cannot be checked in CI), is marked experimental, and its output
gather's backward is meant for inference (reduce-scatter of every rank's identical gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["WanUlysses", "scale_grad"]


def _size_rank(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _seq_to_heads(x: torch.Tensor, heads: int, group: Any) -> torch.Tensor:
    """``[B, N/sp, H*D]`` -> ``[B, N, H/sp*D]`` (lmms_parallel's all-to-all, batch folded)."""
    from lmms_parallel import all_to_all_seq_to_heads

    b, n, hd = x.shape
    d = hd // heads
    y = x.reshape(b, n, heads, d).permute(1, 2, 0, 3).reshape(n, heads, b * d)
    y = all_to_all_seq_to_heads(y, group)  # [N, H/sp, B*D]
    n_full, h_local = y.shape[0], y.shape[1]
    return y.reshape(n_full, h_local, b, d).permute(2, 0, 1, 3).reshape(b, n_full, h_local * d)


def _heads_to_seq(x: torch.Tensor, heads_local: int, group: Any) -> torch.Tensor:
    """``[B, N, H/sp*D]`` -> ``[B, N/sp, H*D]``; the inverse of :func:`_seq_to_heads`."""
    from lmms_parallel import all_to_all_heads_to_seq

    b, n, hd = x.shape
    d = hd // heads_local
    y = x.reshape(b, n, heads_local, d).permute(1, 2, 0, 3).reshape(n, heads_local, b * d)
    y = all_to_all_heads_to_seq(y, group)  # [N/sp, H, B*D]
    n_local, h = y.shape[0], y.shape[1]
    return y.reshape(n_local, h, b, d).permute(2, 0, 1, 3).reshape(b, n_local, h * d)


class _GatherSeq(torch.autograd.Function):
    """All-gather ``[B, N/sp, C]`` along tokens; backward keeps this rank's slice times ``sp``
    (every rank back-propagates the same full gradient, see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        sp, rank = _size_rank(group)
        ctx.sp, ctx.rank, ctx.n = sp, rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo = ctx.rank * ctx.n
        return grad[:, lo : lo + ctx.n] * ctx.sp, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; the gradient is multiplied by ``factor``."""
    return _ScaleGrad.apply(x, factor)


class WanUlysses:
    """Install Ulysses SP on a ``WanTransformer3DModel`` (see the module docstring)."""

    def __init__(self, model: nn.Module, group: Any) -> None:
        self.model, self.group = model, group
        self.sp, self.rank = _size_rank(group)
        self.handles: list[Any] = []
        self.heads: list[tuple[nn.Module, int]] = []

    def install(self) -> WanUlysses:
        heads = self.model.config.num_attention_heads
        if heads % self.sp:
            raise ValueError(f"wan: {heads} attention heads cannot be split over sp={self.sp}")
        group, sp, rank = self.group, self.sp, self.rank
        blocks = list(self.model.blocks)

        def split_tokens(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            x = args[0] if args else kwargs["hidden_states"]  # [B, N, C]
            if x.shape[1] % sp:
                raise ValueError(
                    f"wan SP: {x.shape[1]} video tokens do not split over sp={sp} ranks "
                    "(choose frame/resolution buckets whose token count divides)"
                )
            n = x.shape[1] // sp
            local = x[:, rank * n : (rank + 1) * n]
            return (
                ((local, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": local})
            )

        def gather_tokens(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return _GatherSeq.apply(out, group)

        self.handles.append(blocks[0].register_forward_pre_hook(split_tokens, with_kwargs=True))
        self.handles.append(blocks[-1].register_forward_hook(gather_tokens))
        for block in blocks:
            attn = block.attn1
            self.heads.append((attn, attn.heads))

            def to_heads(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
                return _seq_to_heads(out, heads, group)

            def to_seq(module: nn.Module, args: tuple) -> tuple:
                return (_heads_to_seq(args[0], heads // sp, group), *args[1:])

            for mod in (attn.norm_q, attn.norm_k, attn.to_v):
                self.handles.append(mod.register_forward_hook(to_heads))
            self.handles.append(attn.to_out[0].register_forward_pre_hook(to_seq))
            attn.heads = heads // sp
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for attn, heads in self.heads:
            attn.heads = heads
        self.handles, self.heads = [], []
