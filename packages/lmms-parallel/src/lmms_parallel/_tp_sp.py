"""Sequence parallelism inside tensor parallelism (Megatron SP): the TP styles that keep the
residual stream split over the sequence between the attention and MLP sub-blocks.

Under plain TP every rank of the TP group holds the whole ``[1, T, H]`` residual stream and runs
the norms on all ``T`` tokens. With these styles a rank holds its ``T/tp`` tokens (torch.chunk
bounds: ``ceil(T/tp)`` per rank, the last ones shorter or empty, as DTensor's ``Shard(1)``):

* ``sp_scatter_input`` (on the first decoder layer): its ``hidden_states`` become this rank's
  tokens (backward: the chunks' gradients all-gathered, so the embeddings and the vision tower
  before it, replicated on the TP group, get the whole gradient);
* ``sp_gather_input`` (on attention and MLP modules): their ``hidden_states`` are all-gathered
  to ``[1, T, H]`` for the column-wise q/k/v and gate/up (backward: this rank's rows; the
  column-wise layers' DTensor backward has already summed their partial input gradients);
* ``rowwise_sp`` (o_proj, down_proj): torch's ``RowwiseParallel`` whose output is
  reduce-scattered to ``Shard(1)`` instead of all-reduced;
* ``sum_grad`` on the norms (they see local tokens: their gradient is summed over TP);
* ``sp_gather_output`` (on the final norm, its gradient summed over TP as ``sum_grad``): the
  output all-gathered to ``[1, T, H]`` for the loss, backward takes this rank's rows (the loss
  runs whole on every rank, the vocab-parallel one sums the hidden state's gradient over TP:
  no second reduction);
* a family's own style on the split stream (``apply_tp(..., styles=)``, e.g. lmms_models'
  Qwen3-VL ``sp_deepstack``) finds this rank's rows with :func:`seq_rows` and sums the gradient
  of a replicated input with :func:`sum_grad`.

Attention still sees the whole sequence with the full-length rotary tables and ``cu_seqlens``
the decoder computed (only the hidden states are split), so packing is unchanged. Activation
memory of norms and residuals drops by ``tp``; communication per sub-block is an all-gather and
a reduce-scatter in place of one all-reduce (the same volume).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "SeqGatherInput",
    "SeqGatherOutput",
    "SeqScatterInput",
    "rowwise_sp_style",
    "seq_rows",
    "sum_grad",
]


def _bounds(t: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``rank`` (torch.chunk / DTensor Shard bounds)."""
    c = -(-t // size)
    lo = min(rank * c, t)
    return lo, min(lo + c, t)


def _all_gather_seq(x: torch.Tensor, group: Any, t: int) -> torch.Tensor:
    """``[1, T_r, H]`` chunks of every rank -> ``[1, T, H]`` (chunks padded to equal length)."""
    size = dist.get_world_size(group)
    c = -(-t // size)
    pad = torch.zeros(x.shape[0], c, *x.shape[2:], dtype=x.dtype, device=x.device)
    pad[:, : x.shape[1]] = x
    parts = [torch.empty_like(pad) for _ in range(size)]
    dist.all_gather(parts, pad.contiguous(), group=group)
    spans = [_bounds(t, size, r) for r in range(size)]
    return torch.cat([parts[r][:, : hi - lo] for r, (lo, hi) in enumerate(spans)], dim=1)


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[1, T, H]`` partial sums -> this rank's rows of their sum over ``group``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    t = x.shape[1]
    c = -(-t // size)
    padded = torch.zeros(x.shape[0], c * size, *x.shape[2:], dtype=x.dtype, device=x.device)
    padded[:, :t] = x
    chunks = [p.contiguous() for p in padded.split(c, dim=1)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    lo, hi = _bounds(t, size, rank)
    return out[:, : hi - lo]


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.t = group, x.shape[1]
        lo, hi = _bounds(x.shape[1], dist.get_world_size(group), dist.get_rank(group))
        return x[:, lo:hi].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_gather_seq(grad, ctx.group, ctx.t), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, t: int, reduce: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.t, ctx.reduce = group, t, reduce
        return _all_gather_seq(x, group, t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.reduce:  # partial gradients of column-wise layers: sum and keep my rows
            return _reduce_scatter_seq(grad.contiguous(), ctx.group), None, None, None
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        lo, hi = _bounds(ctx.t, size, rank)  # the whole gradient on every rank: my rows
        return grad[:, lo:hi].contiguous(), None, None, None


#: the whole sequence's length per TP group, recorded by ``sp_scatter_input`` (a host int: the
#: gathers need it for shapes and read no device value); the same pack's for the activation
#: checkpointing recompute in backward
_SEQ_LEN: dict[int, int] = {}


def _seq_len(group: Any) -> int:
    if id(group) not in _SEQ_LEN:
        raise RuntimeError(
            "sp_gather_input / sp_gather_output ran before sp_scatter_input: the TP sequence-"
            "parallel plan needs 'sp_scatter_input' on the first decoder layer"
        )
    return _SEQ_LEN[id(group)]


class _HiddenHook:
    """Replace a module's ``hidden_states`` (keyword or first positional argument)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, module: nn.Module) -> nn.Module:
        def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": self.transform(kwargs["hidden_states"])}
            elif args:
                args = (self.transform(args[0]), *args[1:])
            else:
                raise TypeError(f"{type(_m).__name__} was called without hidden_states")
            return args, kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


class SeqScatterInput(_HiddenHook):
    """``sp_scatter_input``: the module's ``hidden_states [1, T, H]`` -> this rank's rows."""

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        _SEQ_LEN[id(self.group)] = x.shape[1]
        return _Scatter.apply(x, self.group)


class SeqGatherInput(_HiddenHook):
    """``sp_gather_input``: the module's ``hidden_states`` all-gathered over the sequence."""

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        # the column-wise layers' backward (DTensor, Replicate input) already sums their
        # partial input gradients over TP: every rank gets the whole gradient, keeps its rows
        return _Gather.apply(x, self.group, _seq_len(self.group), False)


class SeqGatherOutput:
    """``sp_gather_output`` (the final norm): the module runs on local tokens, so its own
    parameters' gradients are summed over TP (``sum_grad``), and its output is all-gathered over
    the sequence; backward keeps this rank's rows of a gradient every rank holds whole (the
    loss runs on the whole sequence on every rank)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def apply(self, module: nn.Module) -> nn.Module:
        from ._tp import SumGradOverGroup

        group = self.group
        if any(p is not None for p in module.parameters(recurse=False)):
            SumGradOverGroup(group).apply(module)

        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            return _Gather.apply(out, group, _seq_len(group), False)

        module.register_forward_hook(hook)
        return module


def rowwise_sp_style() -> Any:
    """``rowwise_sp``: ``RowwiseParallel`` whose output is reduce-scattered to ``Shard(1)``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=Shard(1), use_local_output=True)


def seq_rows(group: Any) -> tuple[int, int]:
    """This rank's rows ``[lo, hi)`` of the sequence the plan's ``sp_scatter_input`` split over
    ``group`` (for a family's own sequence-parallel style, e.g. lmms_models' ``sp_deepstack``)."""
    return _bounds(_seq_len(group), dist.get_world_size(group), dist.get_rank(group))


def sum_grad(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` through an identity whose backward sums the gradient over ``group`` (a replicated
    input that each rank uses on its own rows)."""
    from ._tp import _SumGrad

    return _SumGrad.apply(x, group)
