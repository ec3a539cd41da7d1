"""Backend ``"triton"`` of fused linear cross-entropy: chunked cuBLAS matmuls + one Triton kernel.

Per chunk of ``c`` tokens (``[T, Hd]`` hidden, ``[V, Hd]`` weight, compute dtype ``cdt``):

1. ``logits = h_c @ W.T (+ b)`` into one reused ``[c, V]`` buffer in ``cdt`` (cuBLAS).
2. :func:`_ce_rows` (one program per row, fp32 math): online max / sum-exp over V in blocks,
   ``loss_row = lse - logit[label]``; then a second pass over the row writes
   ``d loss / d logits = softmax - onehot`` *in place* into the buffer (zeros on ignored rows).
3. ``g_h[c] = grad_c @ W`` (cuBLAS, ``cdt``) and ``g_w += grad_c.T @ h_c`` accumulated in fp32.

Why this beats Liger's layout at Qwen2.5-3B shapes (V=151936): chunks are sized by a byte
budget for the ``cdt`` logits (1 GiB -> ~3.5k tokens, ~5 chunks at 16k tokens instead of Liger's
64 chunks of 256), so the ``[V, Hd]`` weight-gradient accumulation is read and written ~5 times
rather than 64, in fp32 rather than bf16; chunks are balanced (equal sizes) so the last GEMM is
not a sliver. The kernel reads each logit twice and writes it once (~3 GB per 16k tokens,
~1 ms of HBM time) against ~45 ms of GEMMs. Nothing reads a device value on the host: the
count, the loss and every branch stay on the device.

Trade-offs: the gradients are computed during the forward and kept until backward
(``[T, Hd]`` in ``cdt`` + ``[V, Hd]`` fp32), like the torch backend; the ``[c, V]`` gradient of
the logits is rounded to ``cdt`` before its two matmuls (as Liger does). Labels are assumed in
``[0, V)`` or ``ignore_index``; an out-of-range label is never read out of bounds (its target
logit counts as 0), but its loss is meaningless.

Under ``TRITON_INTERPRET=1`` (set before triton is imported: triton's own library functions are
jitted at import) the kernel runs on CPU tensors, which is how the tests exercise it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._flce import scaled_saved_grads

__all__ = ["DEFAULT_BUDGET", "ce_rows", "ce_rows_reference", "linear_cross_entropy"]

DEFAULT_BUDGET = 1 << 30  # bytes for one chunk's [c, V] logits buffer in the compute dtype
_BLOCK = 4096  # vocabulary columns per step on the GPU (8 warps: 16 bf16 per thread)
_BLOCK_INTERPRET = 128  # small, so that tests cover several blocks and a partial last one
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ce_rows(
    logits_ptr,  # [N, V] compute dtype; overwritten by d loss / d logits when WRITE_GRAD
    labels_ptr,  # [N] int
    loss_ptr,  # [N] fp32
    weight_ptr,  # [N] fp32 per-row gradient weights (read when HAS_WEIGHT)
    hit_ptr,  # [N] int8: label logit == row max (written when WRITE_HIT)
    V,
    stride,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WRITE_HIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    target = tl.load(ptr + label, mask=valid & (label >= 0) & (label < V), other=0.0)
    cols = tl.arange(0, BLOCK)
    m = -float("inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    for start in range(0, V, BLOCK):
        x = tl.load(ptr + start + cols, mask=start + cols < V, other=-float("inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, tl.where(valid, lse - target.to(tl.float32), 0.0))
    if WRITE_HIT:
        tl.store(hit_ptr + row, (valid & (target.to(tl.float32) >= m)).to(tl.int8))
    if WRITE_GRAD:
        keep = tl.where(valid, 1.0, 0.0)
        if HAS_WEIGHT:
            keep = keep * tl.load(weight_ptr + row)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(ptr + idx, mask=idx < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(idx == label, 1.0, 0.0)) * keep
            tl.store(ptr + idx, g.to(logits_ptr.dtype.element_ty), mask=idx < V)


def ce_rows(
    logits: torch.Tensor,  # [N, V], rows contiguous; overwritten by the gradient if write_grad
    labels: torch.Tensor,  # [N] int
    ignore_index: int,
    *,
    write_grad: bool,
    block: int | None = None,
    row_weights: torch.Tensor | None = None,  # [N] fp32: scales each row's gradient
    hits: torch.Tensor | None = None,  # [N] int8, written: label logit == row max
) -> torch.Tensor:  # [N] fp32 row losses (0 on ignored rows, unweighted)
    """Launch :func:`_ce_rows`: one program per row, no host synchronisation."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and labels.is_contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return loss
    block = block or (_BLOCK_INTERPRET if _INTERPRET else _BLOCK)
    _ce_rows[(n,)](
        logits, labels, loss,
        loss if row_weights is None else row_weights, loss if hits is None else hits,
        v, logits.stride(0), ignore_index,
        WRITE_GRAD=write_grad, HAS_WEIGHT=row_weights is not None, WRITE_HIT=hits is not None,
        BLOCK=block, num_warps=1 if _INTERPRET else 8,
    )  # fmt: skip
    return loss


def ce_rows_reference(
    logits: torch.Tensor,  # [N, V]
    labels: torch.Tensor,  # [N]
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [N] fp32 losses, [N, V] gradient in logits' dtype
    """Plain-torch :func:`ce_rows` (with ``write_grad=True``), for tests."""
    x = logits.float()
    valid = labels != ignore_index
    y = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(x, dim=-1)
    loss = (lse - x.gather(1, y[:, None]).squeeze(1)) * valid
    grad = (x - lse[:, None]).exp() - torch.nn.functional.one_hot(y, x.shape[1])
    return loss, (grad * valid[:, None]).to(logits.dtype)


@functools.cache
def _fp32_accumulate_mode(device_type: str, dtype: torch.dtype) -> str:
    """How this torch accumulates ``acc += a @ b`` (``a``, ``b`` in ``dtype``) into fp32 ``acc``.

    "addmm": ``addmm(..., out_dtype=float32, out=acc)`` (fp32 output of a bf16/fp16 GEMM, added in
    place: no ``[V, Hd]`` temporary; recent torch on CUDA). "mm": ``acc += mm(..., out_dtype=
    float32)`` (one fp32 temporary). "cast": ``acc += (a @ b).float()`` (product rounded to
    ``dtype`` first; CPU and older torch). Probed once with a 2x2 launch: no host sync.
    """
    if dtype == torch.float32:
        return "addmm"
    one = torch.ones(2, 2, dtype=dtype, device=device_type)
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
        return "addmm"
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    try:
        torch.mm(one, one, out_dtype=torch.float32)
        return "mm"
    except (RuntimeError, NotImplementedError, TypeError):
        return "cast"


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    mode = _fp32_accumulate_mode(acc.device.type, a.dtype)
    if mode == "addmm" and a.dtype == torch.float32:
        torch.addmm(acc, a, b, out=acc)
    elif mode == "addmm":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif mode == "mm":
        acc += torch.mm(a, b, out_dtype=torch.float32)
    else:
        acc += (a @ b).float()


def _chunks(t: int, v: int, itemsize: int, budget: int) -> list[tuple[int, int]]:
    """Balanced ``[start, end)`` token ranges whose ``[c, V]`` logits fit ``budget`` bytes."""
    most = max(1, budget // (v * itemsize))
    n = max(1, -(-t // most))
    size = max(1, -(-t // n))
    return [(s, min(t, s + size)) for s in range(0, max(t, 1), size)]  # T=0: one empty span


class _TritonLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, cdt, budget: int, tw, stats):
        # hidden [T, Hd], weight [V, Hd], bias [V] | None, labels [T], tw [T] fp32 | None,
        # stats: None or (token losses [T] fp32, token hits [T] bool) filled here
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_grad = need_h or need_w or need_b
        (t, hd), v = hidden.shape, weight.shape[0]
        dev = hidden.device
        with torch.autocast(dev.type, enabled=False):
            h_all, w = hidden.to(cdt), weight.to(cdt)
            b = bias.to(cdt) if bias is not None else None
            labels = labels.contiguous()
            spans = _chunks(t, v, w.element_size(), budget)
            buf = torch.empty(spans[0][1] - spans[0][0], v, dtype=cdt, device=dev)  # [c, V]
            losses = []
            hits = torch.zeros(t, dtype=torch.int8, device=dev) if stats is not None else None
            g_h = torch.empty(t, hd, dtype=cdt, device=dev) if need_h else None
            g_w = torch.zeros(v, hd, dtype=torch.float32, device=dev) if need_w else None
            g_b = torch.zeros(v, dtype=torch.float32, device=dev) if need_b else None
            for s, e in spans:
                h, logits = h_all[s:e], buf[: e - s]
                if b is None:
                    torch.mm(h, w.t(), out=logits)
                else:
                    torch.addmm(b, h, w.t(), out=logits)
                losses.append(
                    ce_rows(
                        logits, labels[s:e], ignore_index, write_grad=need_grad,
                        row_weights=None if tw is None else tw[s:e],
                        hits=None if hits is None else hits[s:e],
                    )
                )  # fmt: skip
                grad = logits  # now d loss / d logits
                if need_h:
                    torch.mm(grad, w, out=g_h[s:e])
                if need_w:
                    _accumulate_fp32(g_w, grad.t(), h)
                if need_b:
                    g_b += grad.sum(0, dtype=torch.float32)
            rows = torch.cat(losses)  # [T]
            loss = rows.sum() if tw is None else (rows * tw).sum()
            if stats is not None:
                stats[0].copy_(rows)
                stats[1].copy_(hits.bool())
        ctx.save_for_backward(g_h, g_w, g_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        return (*scaled_saved_grads(ctx, grad_out), None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,  # [T, Hd]
    weight: torch.Tensor,  # [V, Hd]
    bias: torch.Tensor | None,  # [V]
    labels: torch.Tensor,  # [T]
    ignore_index: int,
    compute_dtype: torch.dtype,
    budget: int = DEFAULT_BUDGET,
    *,
    token_weights: torch.Tensor | None = None,  # [T] fp32
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,  # filled: [T] fp32, [T] bool
) -> torch.Tensor:  # fp32 scalar: sum of the counted tokens' (weighted) losses
    return _TritonLinearCE.apply(
        hidden, weight, bias, labels, ignore_index, compute_dtype, budget, token_weights, stats
    )
