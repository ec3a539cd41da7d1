"""Backend ``"triton"`` of :class:`lmms_optim.LowPrecisionAdamW`: one kernel per parameter.

The torch backend makes several passes per chunk (fp32 copies of the moments and the weight, the
update, three draws of random integers, three rounding passes). This kernel reads the gradient,
both moments and the weight once, updates them in fp32 registers with torch's AdamW formula
(decoupled decay, bias corrections; IEEE-rounded ``sqrt`` and division) and stores them back,
rounding each bf16 one stochastically with its own Philox stream (``tl.randint4x(seed,
element index)``: streams 0, 1, 2 for the weight, ``exp_avg`` and ``exp_avg_sq``): about 20 bytes
of traffic per parameter with bf16 weights and moments against ~70 for the torch backend.

The rounding is the same scheme as :func:`lmms_optim.stochastic_round_` (the fp32 bit pattern
plus a uniform 16-bit integer, low bits cleared; infinities and NaNs kept), drawn from another
generator, so the two backends round alike in distribution, not bit for bit; each is
deterministic for a given seed, step and parameter (a resume on the same backend is exact).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ._flat_adamw import Hyper

__all__ = ["lowp_adamw_triton_"]

tl: Any = None  # triton.language, bound by _kernel() on first use
_sr: Any = None
_adamw: Any = None
_BLOCK = 1024


def lowp_adamw_triton_(
    p: torch.Tensor,  # any shape, fp32 or bf16, contiguous; updated in place
    g: torch.Tensor,  # same numel, any float dtype
    m: torch.Tensor,  # same numel, fp32 or bf16
    v: torch.Tensor,  # same numel, fp32 or bf16
    hp: Hyper,
    *,
    seed: int,  # 0 <= seed < 2**31
    stochastic: bool,
    grad_scale: torch.Tensor | None = None,  # [] fp32 on p's device
) -> None:
    """One AdamW step of one parameter and its moments (see the module doc)."""
    n = p.numel()
    if n == 0:
        return
    for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.numel() != n or not t.is_contiguous() or t.device != p.device:
            raise ValueError(f"{name} must be contiguous with {n} elements on {p.device}")
    if not p.is_contiguous():
        raise ValueError("the parameter must be contiguous")
    kernel = _kernel()
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        kernel[(triton_cdiv(n, _BLOCK),)](
            p, g, m, v, p if grad_scale is None else grad_scale, n, seed,
            *hp.kernel_scalars(),
            HAS_SCALE=grad_scale is not None,
            P_SR=stochastic and p.dtype == torch.bfloat16,
            M_SR=stochastic and m.dtype == torch.bfloat16,
            V_SR=stochastic and v.dtype == torch.bfloat16,
            BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel() -> Callable:
    """Built on first use (importing lmms_optim does not import triton); ``tl`` and the helper
    are module globals because Triton's interpreter resolves names there only."""
    global tl, _sr, _adamw
    import triton
    import triton.language as tl

    @triton.jit
    def _adamw(
        p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, scale_ptr,
        decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size,
        HAS_SCALE: tl.constexpr,
    ):  # fmt: skip
        # one block of elements loaded to fp32 registers and stepped: (p, m, v) [BLOCK] fp32
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g * tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = p * decay
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights < 0.5
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        return p, m, v

    @triton.jit
    def _sr(x, r):
        # x fp32 [BLOCK], r int32 random [BLOCK] -> fp32 whose low 16 bits are zero: bf16-exact
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (r & 0xFFFF)) & -65536
        finite = tl.abs(x) < float("inf")  # False for inf and NaN
        return tl.where(finite, rounded.to(tl.float32, bitcast=True), x)

    @triton.jit
    def _lowp_adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, seed,
        decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size,
        HAS_SCALE: tl.constexpr, P_SR: tl.constexpr, M_SR: tl.constexpr, V_SR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # < 2**31: one parameter
        mask = offs < n
        p, m, v = _adamw(
            p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, scale_ptr,
            decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size,
            HAS_SCALE,
        )  # fmt: skip
        if P_SR or M_SR or V_SR:
            r0, r1, r2, _r3 = tl.randint4x(seed, offs)
            if P_SR:
                p = _sr(p, r0.to(tl.int32, bitcast=True))
            if M_SR:
                m = _sr(m, r1.to(tl.int32, bitcast=True))
            if V_SR:
                v = _sr(v, r2.to(tl.int32, bitcast=True))
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)

    return _lowp_adamw_kernel
