"""Muon's memory-bound passes around Newton–Schulz as two Triton kernels, references beside them.

Per matrix of ``n`` elements, with ``g = grad.float() * grad_scale``:

- :func:`momentum_stack_` (before NS): ``M = lerp(M, g, 1-μ)`` in place, the NS input
  ``U = lerp(g, M, μ)`` (nesterov) or ``M`` rounded to bf16 into the matrix's slice of the bucket's
  stack, and one fp32 sum of squares of the rounded ``U`` per program of ``BLOCK`` elements
  (summed by torch afterwards: the Frobenius norm without a pass over the stack, and without
  atomics, so it is deterministic). Reads G (4 or 2 bytes) and M (4), writes M (4) and U (2).
- :func:`apply_` (after NS): ``W = decay·W + O`` (``O`` already times ``-lr·lr_scale``: the
  ``folded`` form of CUDA) or ``W = decay·W + scale·O`` (CPU), in place, and the new ``W``
  rounded to bf16 into its mirror. Reads W (4) and O (2), writes W (4) and the mirror (2).

The arithmetic is torch's, operation for operation: its ``lerp`` is one fused multiply-add
(``fma(w, e - s, s)`` for weights below 0.5, ``fma(w - 1, e - s, e)`` above), ``add`` with
``alpha`` is ``fma(other, alpha, self)``; the kernels call ``tl.fma`` explicitly, so the momentum
buffer and the stack equal the torch reference bit for bit on CPU (AVX2 and Triton's interpreter
both fuse) and on CUDA. bf16 rounding is done on the bit pattern (round to nearest even, NaN kept):
the GPU's conversion does the same, but Triton's interpreter truncates, and the tests want the
interpreter to produce the GPU's bits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._flat_adamw import _triton_usable

__all__ = [
    "BLOCK",
    "apply_",
    "apply_reference",
    "momentum_stack_",
    "momentum_stack_reference",
    "n_partials",
]

BLOCK = 4096  # elements per program (4 warps × 32 threads × 32)
_NUM_WARPS = 4
tl: Any = None  # triton.language and the helpers, bound by _kernels() on first use
_bf16_bits: Any = None
_lerp: Any = None


def n_partials(numel: int) -> int:
    """Sums of squares :func:`momentum_stack_` writes for a matrix of ``numel`` elements."""
    return -(-numel // BLOCK)


def momentum_stack_(
    grad: Tensor,  # [n] fp32 or bf16, read only
    momentum_buffer: Tensor,  # [n] fp32, updated in place
    stack: Tensor,  # [n] bf16: this matrix's slice of the bucket's NS stack
    partials: Tensor,  # [n_partials(n)] fp32: sums of squares of the bf16 U
    grad_scale: Tensor | None,  # [] fp32 (the clip coefficient) or None
    *,
    momentum: float,
    nesterov: bool,
) -> None:
    """One matrix's momentum update and NS input (see the module docstring); Triton only."""
    n = momentum_buffer.numel()
    _check(grad, momentum_buffer, stack, partials, n)
    kernel = _kernels()[0]
    with _on(momentum_buffer):
        kernel[(n_partials(n),)](
            grad, momentum_buffer, stack.view(torch.int16), partials,
            momentum_buffer if grad_scale is None else grad_scale,
            n, _lerp_coefficient(1.0 - momentum), _lerp_coefficient(momentum),
            HAS_SCALE=grad_scale is not None, NESTEROV=nesterov,
            SMALL_W=1.0 - momentum < 0.5, SMALL_MU=momentum < 0.5,
            BLOCK=BLOCK, num_warps=_NUM_WARPS,
        )  # fmt: skip


def momentum_stack_reference(
    grad: Tensor,
    momentum_buffer: Tensor,
    stack: Tensor,
    grad_scale: Tensor | None,
    *,
    momentum: float,
    nesterov: bool,
) -> Tensor:
    """What ``Muon`` does after the clip multiply: the same writes; returns the fp32 sum of
    squares of the bf16 ``U`` (one number, not per program)."""
    g = grad.float()
    if grad_scale is not None:
        g = g * grad_scale
    torch._foreach_lerp_([momentum_buffer], [g], 1 - momentum)
    if nesterov:
        torch.lerp(g, momentum_buffer, momentum, out=stack)
    else:
        stack.copy_(momentum_buffer)
    return torch.linalg.vector_norm(stack, dtype=torch.float32).square()


def apply_(
    master: Tensor,  # [n] fp32, updated in place
    update: Tensor,  # [n] bf16: the NS output, in the master's layout
    mirror: Tensor | None,  # [n] bf16, written from the new master
    *,
    decay: float,
    scale: float,
    folded: bool,
) -> None:
    """``W = decay·W + O`` (``folded``: O carries ``scale`` already) or ``decay·W + scale·O``,
    and the bf16 mirror of the new W; Triton only."""
    n = master.numel()
    for name, t, dtype in (("master", master, torch.float32), ("update", update, None)):
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n or t.device != master.device:
            raise ValueError(f"apply_: {name} must be a contiguous [{n}] tensor beside the master")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"apply_: {name} must be {dtype}, got {t.dtype}")
    if mirror is not None and (mirror.dtype != torch.bfloat16 or mirror.shape != master.shape):
        raise ValueError("apply_: the mirror must be a bf16 tensor of the master's shape")
    _require_triton(master)
    kernel = _kernels()[1]
    with _on(master):
        kernel[(n_partials(n),)](
            master, update, master if mirror is None else mirror.view(torch.int16),
            n, _f32(decay), _f32(scale), FOLDED=folded, HAS_OUT=mirror is not None,
            BLOCK=BLOCK, num_warps=_NUM_WARPS,
        )  # fmt: skip


def apply_reference(
    master: Tensor,
    update: Tensor,
    mirror: Tensor | None,
    *,
    decay: float,
    scale: float,
    folded: bool,
) -> None:
    """``Muon``'s apply op for op, then the copy into the mirror."""
    if not folded:
        master.mul_(decay).add_(update, alpha=scale)
    elif decay != 1.0:
        torch.add(update, master, alpha=decay, out=master)
    else:
        master.add_(update)
    if mirror is not None:
        mirror.copy_(master)


def _lerp_coefficient(weight: float) -> float:
    """torch's lerp multiplies by ``w`` (below 0.5) or ``w - 1`` with ``w`` rounded to fp32 first;
    that product's factor, computed here exactly (Triton's interpreter would keep a Python float
    in fp64)."""
    w = _f32(weight)
    return w if w < 0.5 else w - 1.0  # exact: Sterbenz


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as torch rounds a scalar for an fp32 kernel."""
    return torch.tensor(x, dtype=torch.float32).item()


def _check(grad: Tensor, buf: Tensor, stack: Tensor, partials: Tensor, n: int) -> None:
    expect = {
        "grad": (grad, (torch.float32, torch.bfloat16), n),
        "momentum_buffer": (buf, (torch.float32,), n),
        "stack": (stack, (torch.bfloat16,), n),
        "partials": (partials, (torch.float32,), n_partials(n)),
    }
    for name, (t, dtypes, numel) in expect.items():
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous() or t.numel() != numel:
            raise ValueError(
                f"momentum_stack_: {name} must be a contiguous [{numel}] tensor of "
                f"{' or '.join(map(str, dtypes))}, got {tuple(t.shape)} {t.dtype}"
            )
        if t.device != buf.device:
            raise ValueError(f"momentum_stack_: {name} is on {t.device}, not {buf.device}")
    _require_triton(buf)


def _require_triton(t: Tensor) -> None:
    if not _triton_usable(t):
        raise RuntimeError(
            "the fused Muon kernels need triton and CUDA tensors (or TRITON_INTERPRET=1 for "
            "CPU tests); use backend='torch' here"
        )


def _on(t: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current device: make it the tensor's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.cache
def _kernels() -> tuple[Callable, Callable]:
    """The two kernels, built on first use (importing lmms_optim does not import triton); the
    helpers are module globals because the interpreter resolves names there only."""
    global tl, _bf16_bits, _lerp
    import triton
    import triton.language as tl

    @triton.jit
    def _bf16_bits(x):  # fp32 -> its bf16 bit pattern (int32, low 16 bits), nearest even
        b = x.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return tl.where(x != x, 0x7FC0, r)

    @triton.jit
    def _lerp(s, e, c, SMALL: tl.constexpr):  # torch's lerp(s, e, w); c: _lerp_coefficient(w)
        if SMALL:
            return tl.fma(c, e - s, s)
        return tl.fma(c, e - s, e)

    @triton.jit
    def _momentum_kernel(
        g_ptr, m_ptr, x_ptr, part_ptr, scale_ptr,  # [n] G, M; [n] int16 view of U; [P]; []
        n, weight, mu,  # _lerp_coefficient of 1-μ and of μ
        HAS_SCALE: tl.constexpr, NESTEROV: tl.constexpr, SMALL_W: tl.constexpr,
        SMALL_MU: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:
            g = g * tl.load(scale_ptr)
        m = _lerp(m, g, weight, SMALL_W)  # M = μM + (1-μ)G
        tl.store(m_ptr + offs, m, mask=mask)
        u = m
        if NESTEROV:
            u = _lerp(g, m, mu, SMALL_MU)  # (1-μ)G + μM
        bits = _bf16_bits(u)
        tl.store(x_ptr + offs, bits.to(tl.int16), mask=mask)
        ub = (bits << 16).to(tl.float32, bitcast=True)  # the bf16 value (0 where masked)
        tl.store(part_ptr + pid, tl.sum(ub * ub, axis=0))

    @triton.jit
    def _apply_kernel(
        w_ptr, o_ptr, out_ptr,  # [n] fp32 W, bf16 O, int16 view of the mirror
        n, decay, scale,
        FOLDED: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask)
        o = tl.load(o_ptr + offs, mask=mask).to(tl.float32)
        if FOLDED:
            w = tl.fma(w, decay, o)  # O + decay·W
        else:
            w = tl.fma(o, scale, w * decay)  # decay·W + scale·O
        tl.store(w_ptr + offs, w, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, _bf16_bits(w).to(tl.int16), mask=mask)

    return _momentum_kernel, _apply_kernel
