"""Sequence-parallel plans: ``{module pattern: style}`` for models whose tokens are not split at
the text decoder's inputs (the default, :class:`lmms_parallel.SequenceParallel`).

A model family states the plan as data (lmms_models' ``ModelSpec.sp_plan``; patterns relative to
the model, read as :func:`lmms_parallel.match_plan` reads them); :func:`apply_sp` installs the
styles for one SP group and returns a handle whose ``remove()`` restores the model bit for bit.
The model stays single-device: the collectives are here. Every style of one application is built
by ``factory(ctx)`` from one :class:`SPContext` (the group, its size and rank, and the row length
of the running forward, which the row styles share) and has ``apply(module) -> [undo, ...]``.

Tokens ``[B, N, C]`` (batch first, e.g. a diffusion transformer over latent patches):

* ``sp_split_tokens`` (pre-hook on the first block; its first positional input or
  ``hidden_states``): this rank's ``N/sp`` consecutive tokens (``N % sp == 0``, else it raises);
* ``sp_tokens_to_heads`` (forward hook on the last module of a q, k or v path, e.g. a q/k norm
  over all heads): ``[B, N/sp, H*D] -> [B, N, H/sp*D]`` by all-to-all (heads are contiguous in the
  last dimension: no head count needed);
* ``sp_heads_to_tokens`` (pre-hook on the attention's output projection): the inverse;
* ``sp_local_heads`` (the attention module): its ``heads`` attribute divided by ``sp`` (raises
  unless ``heads % sp == 0``), so the unchanged attention code unflattens the local heads;
* ``sp_gather_tokens`` (pre-hook on the first module after the blocks): ``[B, N/sp, C] ->
  [B, N, C]`` by all-gather; backward: this rank's slice times ``sp``;
* ``sp_replicated_grad`` (forward hook on the last module): identity, gradient divided by ``sp``.

Gradients: after ``sp_gather_tokens`` every rank computes the same whole output and loss; the
replicated tail's gradient is divided by ``sp`` (``sp_replicated_grad``), so the parameters after
the gather (and the condition inputs they read) get ``1/sp`` on every rank and the group's sum is
one process's; the gather's backward gives this rank's tokens their whole gradient back (``* sp``),
so the blocks' parameters get the gradient of their own tokens: FSDP's sum over the
``dp_shard x sp`` mesh gives the single-process gradients, with no collective in backward beyond
the attention's all-to-alls.

Rows ``[T, ...]`` (one packed row whose attention rule a key/value shard cannot honour, e.g.
span masks; ``lmms_parallel._row_sp``): ``sp_row_stack`` and ``sp_row_attention``.

Linear attention (tokens split at the decoder's inputs, ``SequenceParallel``): ``sp_linear_heads``
on a mixer's per-head core (lmms_models' ``DeltaRuleCore``): tokens gathered and heads split
before it, this rank's rows of the per-head parameters, the pack's ``cu_seqlens`` covering the
SP padding; the output back to this rank's tokens after it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._plans import _style, match_plan, register_style
from ._ulysses import _size_rank, all_to_all_heads_to_seq, all_to_all_seq_to_heads

__all__ = ["SPContext", "SPHandle", "apply_sp", "sp_replicated_grad"]


@dataclass(kw_only=True, slots=True)
class SPContext:
    """What the styles of one plan application share: the group, its size and this rank, and
    ``total``, the row length of the running forward (set by ``sp_row_stack``)."""

    group: Any
    size: int
    rank: int
    total: int = 0


@dataclass(kw_only=True, slots=True)
class SPHandle:
    """The installed plan: ``modules`` (names it applied to), ``remove()`` undoes every style."""

    modules: list[str] = field(default_factory=list)
    undo: list[Callable[[], Any]] = field(default_factory=list)

    def remove(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()


def apply_sp(
    root: nn.Module,
    plan: Mapping[str, str],
    group: Any,
    *,
    styles: Mapping[str, Callable[[Any], Any]] | None = None,
) -> SPHandle:
    """Install the sequence-parallel ``plan`` on ``root`` for ``group``; returns the handle."""
    size, rank = _size_rank(group)
    ctx = SPContext(group=group, size=size, rank=rank)
    handle = SPHandle()
    for name, module, style in match_plan(root, plan):
        handle.undo += _style("sp", style, ctx, styles).apply(module)
        handle.modules.append(name)
    return handle


# ------------------------------------------------------------------------------ collectives
class _GatherTokens(torch.autograd.Function):
    """All-gather ``[B, N/sp, C]`` along tokens; backward: this rank's slice times ``sp`` (every
    rank back-propagates the same whole gradient, divided by ``sp`` by ``sp_replicated_grad``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp_ctx: SPContext) -> torch.Tensor:  # type: ignore[override]
        ctx.sp, ctx.rank, ctx.n = sp_ctx.size, sp_ctx.rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sp_ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=sp_ctx.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        lo = ctx.rank * ctx.n
        return grad[:, lo : lo + ctx.n] * ctx.sp, None


def sp_replicated_grad(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` unchanged (a view); its gradient divided by the size of ``group``: a value every SP
    rank computes whole (a loss over the gathered row), so the group's summed gradient is one
    process's."""
    sp, _ = _size_rank(group)
    if sp == 1 or not x.requires_grad:
        return x
    y = x.view_as(x)  # the hook sees only the gradient that flows through this result
    y.register_hook(lambda grad: grad * (1.0 / sp))
    return y


def _tokens_to_heads(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``[B, N/sp, C]`` -> ``[B, N, C/sp]`` (this rank's contiguous channel group = its heads)."""
    b, n, c = x.shape
    y = x.reshape(b, n, sp, c // sp).permute(1, 2, 0, 3).reshape(n, sp, b * (c // sp))
    y = all_to_all_seq_to_heads(y, group)  # [N, 1, B*C/sp]
    return y.reshape(n * sp, b, c // sp).transpose(0, 1).contiguous()


def _heads_to_tokens(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``[B, N, C/sp]`` -> ``[B, N/sp, C]``; the inverse of :func:`_tokens_to_heads`."""
    b, n, cl = x.shape
    y = all_to_all_heads_to_seq(x.transpose(0, 1).reshape(n, 1, b * cl), group)  # [N/sp, sp, .]
    return y.reshape(n // sp, sp, b, cl).permute(2, 0, 1, 3).reshape(b, n // sp, sp * cl)


# ------------------------------------------------------------------------------ token styles
def _on_first_input(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """A ``with_kwargs`` pre-hook replacing the first positional input (or ``hidden_states``)."""

    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


class _Hook:
    """A style that is one hook: ``pre`` (input) or ``post`` (output) with ``fn(tensor)``."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], *, pre: bool) -> None:
        self.fn, self.pre = fn, pre

    def apply(self, module: nn.Module) -> list[Callable[[], Any]]:
        if self.pre:
            h = module.register_forward_pre_hook(_on_first_input(self.fn), with_kwargs=True)
        else:
            h = module.register_forward_hook(lambda _m, _a, out: self.fn(out))
        return [h.remove]


def _split_tokens(ctx: SPContext) -> _Hook:
    def split(x: torch.Tensor) -> torch.Tensor:  # [B, N, C] -> [B, N/sp, C]
        if x.shape[1] % ctx.size:
            raise ValueError(
                f"SP: {x.shape[1]} tokens do not split over sp={ctx.size} ranks "
                "(choose buckets whose token count divides)"
            )
        n = x.shape[1] // ctx.size
        return x[:, ctx.rank * n : (ctx.rank + 1) * n]

    return _Hook(split, pre=True)


class _LocalHeads:
    """``sp_local_heads``: the attention module's ``heads`` attribute, divided by ``sp``."""

    def __init__(self, ctx: SPContext) -> None:
        self.sp = ctx.size

    def apply(self, module: nn.Module) -> list[Callable[[], Any]]:
        heads = module.heads
        if heads % self.sp:
            raise ValueError(f"{heads} attention heads cannot be split over sp={self.sp}")
        module.heads = heads // self.sp

        def undo() -> None:
            module.heads = heads

        return [undo]


register_style("sp", "sp_split_tokens")(_split_tokens)
register_style("sp", "sp_tokens_to_heads")(
    lambda ctx: _Hook(lambda x: _tokens_to_heads(x, ctx.group, ctx.size), pre=False)
)
register_style("sp", "sp_heads_to_tokens")(
    lambda ctx: _Hook(lambda x: _heads_to_tokens(x, ctx.group, ctx.size), pre=True)
)
register_style("sp", "sp_local_heads")(_LocalHeads)
register_style("sp", "sp_gather_tokens")(
    lambda ctx: _Hook(lambda x: _GatherTokens.apply(x, ctx), pre=True)
)
register_style("sp", "sp_replicated_grad")(
    lambda ctx: _Hook(lambda x: sp_replicated_grad(x, ctx.group), pre=False)
)


# ------------------------------------------------------------------------------ linear attention
#: (pack cu_seqlens, row length, its cover) of the last few packs: every linear layer of a
#: forward (and its recompute) gets the same cover, read on the host once
_COVERS: collections.deque[tuple[torch.Tensor, int, torch.Tensor]] = collections.deque(maxlen=4)


def _cover(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``cu`` with the SP padding tail (tokens past ``cu[-1]``) as its own last segment; the same
    tensor for the same ``cu`` (one host read per pack, and flash-linear-attention's identity
    cache of chunk indices hits in every layer)."""
    memo = not torch.compiler.is_compiling()
    if memo:
        for src, n, out in _COVERS:
            if src is cu and n == total:
                return out
    last = int(cu[-1])
    if last > total:
        raise ValueError(f"cu_seqlens ends at {last} but the row has {total} tokens")
    out = cu if last == total else torch.cat([cu, cu.new_tensor([total])])
    if memo:
        _COVERS.append((cu, total, out))
    return out


def _local_rows(t: torch.Tensor | None, ctx: SPContext, heads: int) -> torch.Tensor | None:
    """This rank's rows of a per-head (or per-head-channel) parameter, ``heads`` heads in all."""
    if t is None:
        return None
    per, n = t.shape[0] // heads, heads // ctx.size
    return t[ctx.rank * n * per : (ctx.rank + 1) * n * per]


class _LinearHeads:
    """``sp_linear_heads``: Ulysses SP around a linear-attention core called with keywords
    ``q, k`` ``[T/sp, Hk, D]``, ``v`` ``[T/sp, Hv, Dv]``, ``a, b`` ``[T/sp, Hv]`` (decay and
    write-strength inputs), ``cu_seqlens`` (the pack's, global), per-head parameters ``conv_w``
    / ``conv_b`` (tuples over q, k, v; rows per head channel; or None), ``a_log``, ``dt_bias``
    ``[Hv]``, returning ``[T, Hv, Dv]``. Pre-hook: one all-to-all per input (tokens gathered,
    heads split), this rank's rows of the per-head parameters, and ``cu_seqlens`` covering the SP
    padding tail as its own segment (the convolution and recurrence run on whole samples);
    forward hook: the output back to this rank's tokens by one all-to-all."""

    def __init__(self, ctx: SPContext) -> None:
        self.ctx = ctx

    def _heads_in(self, _m: nn.Module, args: tuple, kw: dict) -> tuple[tuple, dict]:
        ctx = self.ctx
        hk, hv = kw["k"].shape[1], kw["v"].shape[1]
        if hk % ctx.size or hv % ctx.size:
            raise NotImplementedError(
                f"Ulysses SP splits the linear-attention heads over the ranks: key heads ({hk}) "
                f"and value heads ({hv}) must be multiples of sp={ctx.size}"
            )
        out = {n: all_to_all_seq_to_heads(kw[n], ctx.group) for n in ("q", "k", "v")}
        for n in ("a", "b"):
            out[n] = all_to_all_seq_to_heads(kw[n][..., None], ctx.group)[..., 0]
        if kw.get("conv_w") is not None:
            out["conv_w"] = tuple(
                _local_rows(w, ctx, h) for w, h in zip(kw["conv_w"], (hk, hk, hv))
            )
            out["conv_b"] = tuple(
                _local_rows(c, ctx, h) for c, h in zip(kw["conv_b"], (hk, hk, hv))
            )
        out["a_log"], out["dt_bias"] = (_local_rows(kw[n], ctx, hv) for n in ("a_log", "dt_bias"))
        out["cu_seqlens"] = _cover(kw["cu_seqlens"], out["q"].shape[0])
        return args, {**kw, **out}

    def apply(self, module: nn.Module) -> list[Callable[[], Any]]:
        if self.ctx.size == 1:
            return []
        pre = module.register_forward_pre_hook(self._heads_in, with_kwargs=True)
        post = module.register_forward_hook(
            lambda _m, _a, o: all_to_all_heads_to_seq(o, self.ctx.group)
        )
        return [pre.remove, post.remove]


register_style("sp", "sp_linear_heads")(_LinearHeads)
