"""The varlen linear-attention ops as ``torch.library`` custom ops: opaque to ``torch.compile``.

Inside a compiled region :func:`~lmms_kernels.causal_conv1d_varlen` and
:func:`~lmms_kernels.gated_delta_rule_varlen` call ``torch.ops.lmms_kernels.conv1d_varlen`` and
``torch.ops.lmms_kernels.delta_rule_varlen`` instead of the backend: dynamo and AOTAutograd see
one op with a shape-only fake (no trace of flash-linear-attention's Python around its Triton
kernels, no host read of ``cu_seqlens`` by the torch reference) and a registered backward, so a
Gated DeltaNet block compiles without graph breaks, also inside activation checkpointing (a
graph break there would leave the whole checkpointed block uncompiled). Eager calls keep
calling the backends directly (``_linear_attention.py``).

Ops (schemas below):

- ``conv1d_varlen(x, weight, bias, cu, activation, backend) -> y`` and
  ``conv1d_varlen_backward(dy, x, weight, bias, cu, activation, backend) -> (dx, dw, db)``
  (``db`` is empty without a bias);
- ``delta_rule_varlen(q, k, v, g, beta, cu, scale, qk_l2norm, chunk_size, backend) -> o`` and
  ``delta_rule_varlen_backward(do, q, k, v, g, beta, ...same...) -> (dq, dk, dv, dg, dbeta)``.

Both backward ops recompute the forward with autograd on and return ``torch.autograd.grad`` of it
(``varlen_attn_backward``'s helper for backends without an exposed backward): correct for every
installed flash-linear-attention version, without calling its internal backward functions, at
the price of one extra forward of the op per backward (the delta rule's kernels are a small part
of a layer; the projections dominate).
"""

from __future__ import annotations

import torch

from . import _linear_attention as _L
from ._attention_ops import grads_by_recompute

__all__: list[str] = []

_CONV_ARGS = "Tensor x, Tensor weight, Tensor? bias, Tensor cu, str? activation, str backend"
_RULE_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu, float scale, "
    "bool qk_l2norm, int chunk_size, str backend"
)


# ---------------------------------------------------------------- short causal convolution


@torch.library.custom_op(
    "lmms_kernels::conv1d_varlen", mutates_args=(), schema=f"({_CONV_ARGS}) -> Tensor"
)
def conv1d_varlen(x, weight, bias, cu, activation, backend):
    return _L.causal_conv1d_varlen(
        x, weight, bias, cu, activation=activation, backend=backend
    ).contiguous()


@conv1d_varlen.register_fake
def _(x, weight, bias, cu, activation, backend):
    return x.new_empty(x.shape)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, cu, activation, backend = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, cu)
    ctx.args = (activation, backend)


def _conv_backward(ctx, dy):
    x, weight, bias, cu = ctx.saved_tensors
    dx, dw, db = torch.ops.lmms_kernels.conv1d_varlen_backward(dy, x, weight, bias, cu, *ctx.args)
    return dx, dw, (db if ctx.has_bias else None), None, None, None


conv1d_varlen.register_autograd(_conv_backward, setup_context=_conv_setup)


@torch.library.custom_op(
    "lmms_kernels::conv1d_varlen_backward",
    mutates_args=(),
    schema=f"(Tensor dy, {_CONV_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def conv1d_varlen_backward(dy, x, weight, bias, cu, activation, backend):
    def fn(x, weight, bias):
        return _L.causal_conv1d_varlen(x, weight, bias, cu, activation=activation, backend=backend)

    return tuple(g.contiguous() for g in grads_by_recompute(fn, dy.contiguous(), [x, weight, bias]))


@conv1d_varlen_backward.register_fake
def _(dy, x, weight, bias, cu, activation, backend):
    db = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


# ---------------------------------------------------------------- gated delta rule


@torch.library.custom_op(
    "lmms_kernels::delta_rule_varlen", mutates_args=(), schema=f"({_RULE_ARGS}) -> Tensor"
)
def delta_rule_varlen(q, k, v, g, beta, cu, scale, qk_l2norm, chunk_size, backend):
    out = _L.gated_delta_rule_varlen(
        q, k, v, g, beta, cu, scale=scale, qk_l2norm=qk_l2norm, chunk_size=chunk_size,
        backend=backend,
    )  # fmt: skip
    return out.contiguous()


@delta_rule_varlen.register_fake
def _(q, k, v, g, beta, cu, scale, qk_l2norm, chunk_size, backend):
    return v.new_empty(v.shape)


def _rule_setup(ctx, inputs, output):
    q, k, v, g, beta, cu, *args = inputs
    ctx.save_for_backward(q, k, v, g, beta, cu)
    ctx.args = tuple(args)


def _rule_backward(ctx, do):
    q, k, v, g, beta, cu = ctx.saved_tensors
    grads = torch.ops.lmms_kernels.delta_rule_varlen_backward(do, q, k, v, g, beta, cu, *ctx.args)
    return (*grads, None, None, None, None, None)


delta_rule_varlen.register_autograd(_rule_backward, setup_context=_rule_setup)


@torch.library.custom_op(
    "lmms_kernels::delta_rule_varlen_backward",
    mutates_args=(),
    schema=f"(Tensor do, {_RULE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def delta_rule_varlen_backward(do, q, k, v, g, beta, cu, scale, qk_l2norm, chunk_size, backend):
    def fn(q, k, v, g, beta):
        return _L.gated_delta_rule_varlen(
            q, k, v, g, beta, cu, scale=scale, qk_l2norm=qk_l2norm, chunk_size=chunk_size,
            backend=backend,
        )  # fmt: skip

    return tuple(
        t.contiguous() for t in grads_by_recompute(fn, do.contiguous(), [q, k, v, g, beta])
    )


@delta_rule_varlen_backward.register_fake
def _(do, q, k, v, g, beta, cu, scale, qk_l2norm, chunk_size, backend):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta))
