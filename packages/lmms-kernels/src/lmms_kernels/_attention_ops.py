"""``varlen_attention`` as ``torch.library`` custom ops: opaque to ``torch.compile``.

Inside a compiled region ``varlen_attention`` calls ``torch.ops.lmms_kernels.varlen_attn``
instead of the backend: dynamo and AOTAutograd see one op with a shape-only fake (no host read
of ``cu_seqlens``) and a registered backward, so a transformer block compiles into one graph
(no graph break), and ``max_seqlen`` ints stay SymInts (a new pack's lengths neither recompile
nor sync inside the graph). Eager calls keep calling the backends directly (``_attention.py``).

Ops (schemas below):

- ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, backend) -> (out, lse)``.
  ``lse`` is fp32 ``[H, Tq]`` for backends whose backward consumes it, else ``[H, 0]``.
  ``lse`` is not differentiable. ``max_q/max_k < 0`` means "read it from ``cu_seqlens`` on the
  host" (the caller only had a 0-d tensor, as Qwen-VL vision attention passes).
- ``varlen_attn_backward(dout, q, k, v, out, lse, ..same..) -> (dq, dk, dv)``.

Backward per backend:

- ``fa4``: FA4's own ``_flash_attn_fwd(return_lse=True)`` / ``_flash_attn_bwd`` (the functions
  ``flash_attn.cute.flash_attn_varlen_func``'s autograd.Function calls), head dims padded as in
  eager.
- ``torch``: ``aten._flash_attention_forward`` / ``_flash_attention_backward`` (what
  ``torch.nn.attention.varlen.varlen_attn`` calls on its flash path; its own op signatures
  change between torch releases, the aten ones do not).
- ``fa`` (FA2/FA3), ``flex``, ``sdpa``: the backward op recomputes the forward with autograd on
  and returns ``torch.autograd.grad`` of it. Correct for every installed version, at the price
  of one extra attention forward per backward. flash-attn 2/3 internals change signature
  between releases and are not installed where we measure, so they are not called directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import _attention as _A

__all__: list[str] = []

_LSE_BACKENDS = frozenset({"fa4", "torch"})
_ARGS = "SymInt max_q, SymInt max_k, bool causal, float? scale, str backend"


def _host_max(cu: torch.Tensor, mx: int) -> int:
    return int(torch.diff(cu).max()) if mx < 0 and cu.numel() > 1 else max(int(mx), 0)


def _resolve(backend, q, cu_q, cu_k, max_q, max_k):
    name = _A.resolve_backend(backend, q.device, q.dtype)
    return name, _host_max(cu_q, max_q), _host_max(cu_k, max_k)


# ---------------------------------------------------------------- forward


@torch.library.custom_op(
    "lmms_kernels::varlen_attn",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, {_ARGS}) -> (Tensor, Tensor)",
)
def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, backend):
    name, max_q, max_k = _resolve(backend, q, cu_q, cu_k, max_q, max_k)
    _A.record_call("op", name, q, k, v, causal, scale)
    if name == "fa4":
        out, lse = _fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    elif name == "torch":
        out, lse = _aten_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    else:
        out = _A._IMPLS[name](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        lse = q.new_empty(q.shape[1], 0, dtype=torch.float32)
    return out.contiguous(), lse.contiguous()


@varlen_attn.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, backend):
    name = _A.resolve_backend(backend, q.device, q.dtype)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    n = q.shape[0] if name in _LSE_BACKENDS else 0
    return out, q.new_empty(q.shape[1], n, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, backend)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.lmms_kernels.varlen_attn_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args
    )
    return dq, dk, dv, None, None, None, None, None, None, None


varlen_attn.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- backward


@torch.library.custom_op(
    "lmms_kernels::varlen_attn_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_q, "
    f"Tensor cu_k, {_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def varlen_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, backend):
    name, max_q, max_k = _resolve(backend, q, cu_q, cu_k, max_q, max_k)
    dout = dout.contiguous()
    if name == "fa4":
        grads = _fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    elif name == "torch":
        grads = _aten_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    else:
        grads = _recompute_bwd(name, dout, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    return tuple(g.contiguous() for g in grads)


@varlen_attn_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _recompute_bwd(name, dout, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Gradients by re-running the backend's forward under autograd."""

    def forward(q, k, v):
        return _A._IMPLS[name](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    return tuple(grads_by_recompute(forward, dout, [q, k, v]))


def grads_by_recompute(
    fn: Callable[..., torch.Tensor], grad_out: torch.Tensor, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """``d fn(*inputs) / d inputs`` for ``grad_out``, from inside a custom op's backward kernel
    (zeros for an unused input, an empty tensor for a None one).

    A custom op's kernel runs with the autograd dispatch keys excluded (it is "below" autograd),
    so ``enable_grad`` alone records nothing; the exclusion is lifted for this block only.
    """
    autograd_key = torch._C.DispatchKey.AutogradFunctionality
    with torch._C._SetExcludeDispatchKeyGuard(autograd_key, False), torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
    result = []
    for t in leaves:
        if t is None:
            result.append(grad_out.new_empty(0))
            continue
        g = next(grads)
        result.append(torch.zeros_like(t) if g is None else g)
    return result


# ---------------------------------------------------------------- FA4 (flash_attn.cute)


def _fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    from flash_attn.cute.interface import _flash_attn_fwd

    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    res = _A._fa4_call(_flash_attn_fwd, *args, return_lse=True)
    return res[0][..., : v.shape[-1]], res[1]  # [Tq, H, Dv], [H, Tq] fp32


def _fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    from flash_attn.cute.interface import _flash_attn_bwd

    d, dv = q.shape[-1], v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q, k, v, _, pv = _A._fa4_pad(q, k, v)
    if pv:  # padded output columns are zero, as are their incoming gradients
        out, dout = F.pad(out, (0, pv)), F.pad(dout, (0, pv))
    dq, dk, dvv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        scale,
        causal,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )[:3]
    return dq[..., :d], dk[..., :d], dvv[..., :dv]


# ---------------------------------------------------------------- torch (aten flash)


def _gqa_native() -> bool:
    return "enable_gqa" in _A._torch_varlen_params()


def _aten_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    if not _gqa_native():  # as the eager backend does on torch without enable_gqa
        n_rep = q.shape[1] // k.shape[1]
        k, v = _A._repeat_kv(k, n_rep), _A._repeat_kv(v, n_rep)
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return res[0], res[1]  # [Tq, H, Dv], [H, Tq] fp32


def _aten_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    kv_heads = k.shape[1]
    n_rep = 1 if _gqa_native() else q.shape[1] // kv_heads
    k, v = _A._repeat_kv(k, n_rep), _A._repeat_kv(v, n_rep)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused by the kernel
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
    )[:3]
    if n_rep > 1:  # sum the gradients of the repeated KV heads
        dk = dk.unflatten(1, (kv_heads, n_rep)).sum(2)
        dv = dv.unflatten(1, (kv_heads, n_rep)).sum(2)
    return dq, dk, dv
