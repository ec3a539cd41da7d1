"""Vocabulary-parallel LM head and cross-entropy: the TP loss that never gathers ``[T, vocab]``.

The ``"vocab_parallel"`` TP style shards the LM head's weight ``[V, H]`` by rows over the ``tp``
mesh dim (DTensor ``Shard(0)``: rank ``r`` holds vocabulary rows ``[r·V/tp, (r+1)·V/tp)``).
Called directly, the head still returns whole logits (all-gathered, for generation and eval); the
training loss reads the local shard instead (:func:`vocab_parallel_shard`) and runs
:func:`vocab_parallel_cross_entropy` over chunks of tokens:

* forward, per chunk ``[C, V/tp]`` of local logits (fp32): the row max is all-reduced (MAX), then
  the sum of ``exp(logit - max)`` and the target's logit (taken by the rank whose rows hold the
  label, zero elsewhere) are all-reduced together (SUM); ``loss = log(sumexp) + max - target``;
* backward, per chunk (logits recomputed): ``softmax - onehot`` on the local columns gives the
  local weight's gradient and this rank's part of the hidden state's gradient, summed over the TP
  group once at the end (every rank holds the whole hidden state, as every layer's replicated
  output does under the Megatron pairs).

Memory: ``[C, V/tp]`` fp32 per chunk, never ``[T, V]``. Communication per chunk: two all-reduces
of ``C`` and ``2·C`` floats forward, one ``[T, H]`` all-reduce in backward. A plain-torch
reference over the whole logits (one process) is what the tests compare against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["VocabParallelHead", "vocab_parallel_cross_entropy", "vocab_parallel_shard"]

IGNORE_INDEX = -100


class VocabParallelHead:
    """The ``"vocab_parallel"`` TP style for an ``nn.Linear`` LM head (weight ``[V, H]``)."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def apply(self, module: nn.Module) -> nn.Module:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        if not isinstance(module, nn.Linear):
            raise TypeError(f"'vocab_parallel' wants an nn.Linear LM head, got {type(module)}")
        tp = self.mesh.size()
        if module.out_features % tp:
            raise ValueError(
                f"'vocab_parallel': the vocabulary ({module.out_features}) must divide by tp={tp}"
            )
        # a direct call returns whole logits; the loss reads the shard (vocab_parallel_shard)
        style = ColwiseParallel(output_layouts=Replicate(), use_local_output=True)
        parallelize_module(module, self.mesh, style)
        return module


def vocab_parallel_shard(weight: torch.Tensor) -> tuple[torch.Tensor, Any, int] | None:
    """``(local rows [V/tp, H], TP group, first vocabulary row)`` when ``weight`` is a
    ``Shard(0)`` DTensor on a 1-D mesh (the ``"vocab_parallel"`` head, FSDP2-unsharded), else
    ``None`` (a plain or replicated head: the ordinary fused loss applies)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1:
        return None
    if tuple(weight.placements) != (Shard(0),):
        return None
    mesh = weight.device_mesh
    local = weight.to_local()
    rows = weight.shape[0] // mesh.size()
    return local, mesh.get_group(), mesh.get_local_rank() * rows


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [V/tp, H] local rows
        bias: torch.Tensor | None,  # [V/tp]
        labels: torch.Tensor,  # [T] global ids, IGNORE_INDEX where no loss
        group: Any,
        start: int,
        chunk: int,
    ) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        local = labels - start
        mine = valid & (local >= 0) & (local < weight.shape[0])  # [T]: label in my rows
        lse = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [T]
        loss = torch.zeros_like(lse)  # [T] per token
        for lo in range(0, hidden.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            logits = _logits(hidden[sl], weight, bias)  # [C, V/tp] fp32
            top = logits.max(1).values  # [C]
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            idx = local[sl].clamp(0, weight.shape[0] - 1)[:, None]
            target = logits.gather(1, idx)[:, 0] * mine[sl]  # [C], zero off my rows
            both = torch.stack([(logits - top[:, None]).exp().sum(1), target])  # [2, C]
            dist.all_reduce(both, group=group)
            lse[sl] = both[0].log() + top
            loss[sl] = lse[sl] - both[1]
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.group, ctx.start, ctx.chunk = group, start, chunk
        return (loss * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        valid = labels != IGNORE_INDEX
        local = labels - ctx.start
        mine = valid & (local >= 0) & (local < weight.shape[0])
        g_hidden = torch.empty_like(hidden)
        g_weight = torch.zeros_like(weight, dtype=torch.float32)
        g_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        for lo in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(lo, lo + ctx.chunk)
            logits = _logits(hidden[sl], weight, bias)  # [C, V/tp]
            p = (logits - lse[sl, None]).exp()  # softmax on my columns
            idx = local[sl].clamp(0, weight.shape[0] - 1)[:, None]  # no host read (no nonzero)
            p.scatter_add_(1, idx, -mine[sl, None].to(p.dtype))  # minus the one-hot label
            p = p * (grad * valid[sl])[:, None]  # [C, V/tp] d loss / d logits
            g_hidden[sl] = (p.to(hidden.dtype) @ weight).to(hidden.dtype)
            g_weight += p.t() @ hidden[sl].float()
            g_bias += p.sum(0)
        dist.all_reduce(g_hidden, group=ctx.group)  # every rank's columns' part
        g_b = g_bias.to(bias.dtype) if bias is not None else None
        return g_hidden, g_weight.to(weight.dtype), g_b, None, None, None, None


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = (h @ w.t()).float()  # [C, V/tp]
    return out if b is None else out + b.float()


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [V/tp, H] this rank's vocabulary rows
    labels: torch.Tensor,  # [T] global vocabulary ids (IGNORE_INDEX: no loss)
    *,
    group: Any,
    start: int,
    bias: torch.Tensor | None = None,  # [V/tp]
    chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum fp32 scalar, n_loss_tokens int64 scalar)`` of next-token cross-entropy with
    the vocabulary split over ``group`` (see the module docstring); the same values on every rank
    of the group, and gradients for ``hidden`` (whole) and the local ``weight``/``bias`` rows."""
    labels = labels.reshape(-1)
    n = (labels != IGNORE_INDEX).sum()
    loss = _VocabParallelCE.apply(hidden, weight, bias, labels, group, start, chunk)
    return loss, n
