"""Triton kernels for batched Newton–Schulz, each with its plain-torch reference beside it.

Per iteration on a stack ``X [B, m, n]`` (``m <= n``, bf16, contiguous):

1. ``gram``: ``A = X Xᵀ`` — symmetric, so only tiles on or above the diagonal are computed and
   each off-diagonal tile is stored twice (itself and its transpose): half the FLOPs.
2. ``gram`` with epilogue: ``B = c·A Aᵀ + b·A`` — ``A`` is symmetric, so ``A² = A Aᵀ`` and the
   same upper-triangle kernel applies; ``b·A`` is added in fp32 before the single bf16 rounding.
3. ``fused_step``: ``X' = a·X + B X`` — one matmul whose epilogue adds ``a·X``.

Step 3 is also available through cuBLAS (``torch.baddbmm(X, B, X, beta=a)``), which fuses the
same epilogue; :func:`ns_triton` uses it by default (``step="baddbmm"``) because a general
``m × m`` by ``m × n`` product has no symmetry to exploit and cuBLAS is the faster GEMM on Hopper;
``step="triton"`` selects the Triton kernel (the benchmark measures both).

The batch axis is the second grid axis: one launch covers every matrix of a stack (for example
the same projection of every layer). All kernels take strides, accumulate in fp32 and round once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "fused_step",
    "fused_step_reference",
    "gram",
    "gram_reference",
    "ns_triton",
]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _gram_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK": 128, "BLOCK_K": 32}, num_warps=4, num_stages=5),
        triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    ]


def _step_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP": 2}, num_warps=1)
        ]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP": 8}, num_warps=4, num_stages=4),
    ]  # fmt: skip


@triton.autotune(configs=_gram_configs(), key=["M", "K"])
@triton.jit
def _gram_kernel(
    x_ptr, c_ptr, e_ptr,  # X [B, M, K]; C, E [B, M, M]
    M, K,
    sxb, sxm, sxk,
    scb, scm, scn,
    seb, sem, sen,
    alpha, beta,
    HAS_EPILOGUE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bid = tl.program_id(1).to(tl.int64)
    tiles = tl.cdiv(M, BLOCK)
    pid_m = pid // tiles
    pid_n = pid % tiles
    if pid_m > pid_n:  # lower triangle: written by the mirrored tile
        return
    rm = pid_m * BLOCK + tl.arange(0, BLOCK)
    rn = pid_n * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    x_base = x_ptr + bid * sxb
    a_ptrs = x_base + rm[:, None] * sxm + rk[None, :] * sxk  # [BLOCK, BLOCK_K]
    b_ptrs = x_base + rn[:, None] * sxm + rk[None, :] * sxk  # rows of X for the Xᵀ tile
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk[None, :] < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok, other=0.0)
        b = tl.load(b_ptrs, mask=(rn[:, None] < M) & k_ok, other=0.0)
        if UPCAST:  # the CPU interpreter cannot dot bf16 tiles
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, tl.trans(b))
        a_ptrs += BLOCK_K * sxk
        b_ptrs += BLOCK_K * sxk
    mask = (rm[:, None] < M) & (rn[None, :] < M)
    if HAS_EPILOGUE:
        e = tl.load(e_ptr + bid * seb + rm[:, None] * sem + rn[None, :] * sen, mask=mask, other=0.0)
        acc = alpha * acc + beta * e.to(tl.float32)
    out = acc.to(c_ptr.dtype.element_ty)
    c_base = c_ptr + bid * scb
    tl.store(c_base + rm[:, None] * scm + rn[None, :] * scn, out, mask=mask)
    if pid_m != pid_n:
        mask_t = (rn[:, None] < M) & (rm[None, :] < M)
        tl.store(c_base + rn[:, None] * scm + rm[None, :] * scn, tl.trans(out), mask=mask_t)


@triton.autotune(configs=_step_configs(), key=["M", "N"])
@triton.jit
def _step_kernel(
    b_ptr, x_ptr, o_ptr,  # B [Bt, M, M]; X, O [Bt, M, N]
    M, N,
    sbb, sbm, sbk,
    sxb, sxm, sxn,
    sob, som, son,
    a_coef, alpha, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bid = tl.program_id(1).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP row-tiles share the streamed X column tiles in L2.
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    b_ptrs = b_ptr + bid * sbb + rm[:, None] * sbm + rk[None, :] * sbk  # [BLOCK_M, BLOCK_K]
    x_ptrs = x_ptr + bid * sxb + rk[:, None] * sxm + rn[None, :] * sxn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(M, BLOCK_K)):
        k_left = M - k * BLOCK_K
        bb = tl.load(b_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        xx = tl.load(x_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            bb = bb.to(tl.float32)
            xx = xx.to(tl.float32)
        acc += tl.dot(bb, xx)
        b_ptrs += BLOCK_K * sbk
        x_ptrs += BLOCK_K * sxm
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x_tile = tl.load(
        x_ptr + bid * sxb + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0
    )
    acc = alpha * acc + a_coef * x_tile.to(tl.float32)
    tl.store(o_ptr + bid * sob + rm[:, None] * som + rn[None, :] * son, acc.to(o_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    return t if t.ndim == 3 else t.unsqueeze(0)


def gram(
    X: torch.Tensor,
    *,
    epilogue: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha·X Xᵀ + beta·E`` for X ``[B, m, k]`` (or ``[m, k]``); E must be symmetric ``[B, m, m]``.

    Only the upper tiles are computed; each is mirrored, so the result is exactly symmetric.
    """
    X3 = _as_batch(X)
    nb, m, k = X3.shape
    C = out if out is not None else torch.empty(nb, m, m, device=X.device, dtype=X.dtype)
    C3 = _as_batch(C)
    E3 = _as_batch(epilogue) if epilogue is not None else C3
    tiles = lambda meta: (triton.cdiv(m, meta["BLOCK"]) ** 2, nb)  # noqa: E731
    _gram_kernel[tiles](
        X3, C3, E3, m, k,
        *X3.stride(), *C3.stride(), *E3.stride(),
        float(alpha), float(beta),
        HAS_EPILOGUE=epilogue is not None, UPCAST=_INTERPRET,
    )  # fmt: skip
    return C if X.ndim == 3 or out is not None else C3[0]


def gram_reference(
    X: torch.Tensor, *, epilogue: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0
) -> torch.Tensor:
    acc = (X.float() @ X.float().mT) * alpha
    if epilogue is not None:
        acc = acc + beta * epilogue.float()
    return acc.to(X.dtype)


def fused_step(
    B: torch.Tensor,
    X: torch.Tensor,
    a: float,
    *,
    alpha: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a·X + alpha·B X`` for B ``[Bt, m, m]``, X ``[Bt, m, n]`` (or unbatched), fp32 accumulation."""
    B3, X3 = _as_batch(B), _as_batch(X)
    nb, m, n = X3.shape
    res = out if out is not None else torch.empty_like(X)
    O3 = _as_batch(res)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), nb)  # noqa: E731
    _step_kernel[grid](
        B3,
        X3,
        O3,
        m,
        n,
        *B3.stride(),
        *X3.stride(),
        *O3.stride(),
        float(a),
        float(alpha),
        UPCAST=_INTERPRET,
    )
    return res


def fused_step_reference(
    B: torch.Tensor, X: torch.Tensor, a: float, *, alpha: float = 1.0
) -> torch.Tensor:
    return (a * X.float() + alpha * (B.float() @ X.float())).to(X.dtype)


def ns_triton(
    X: torch.Tensor,
    coeffs: Sequence[tuple[float, float, float]],
    *,
    step: str | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Newton–Schulz on a prepared stack X ``[B, m, n]`` (bf16, contiguous, m <= n, scaled).

    Returns ``scale · NS(X)`` (the scale rides in the last step's epilogue); X's storage is reused
    as a work buffer. ``step``: ``"baddbmm"`` (cuBLAS, default on CUDA) or ``"triton"`` (default under the
    interpreter); overridable with env ``LMMS_OPTIM_NS_STEP``.
    """
    step = step or os.environ.get("LMMS_OPTIM_NS_STEP") or ("triton" if _INTERPRET else "baddbmm")
    if step not in ("baddbmm", "triton"):
        raise ValueError(f"step must be 'baddbmm' or 'triton', got {step!r}")
    nb, m, _ = X.shape
    A = torch.empty(nb, m, m, device=X.device, dtype=X.dtype)
    Bm = torch.empty_like(A)
    Y = torch.empty_like(X)
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        s = scale if i == last else 1.0
        gram(X, out=A)  # A = X Xᵀ
        gram(A, epilogue=A, alpha=c, beta=b, out=Bm)  # B = c·A² + b·A
        if step == "triton":
            fused_step(Bm, X, a * s, alpha=s, out=Y)
        elif nb == 1:  # 2-D cuBLAS call: less host time than a batch of one
            torch.addmm(X[0], Bm[0], X[0], beta=a * s, alpha=s, out=Y[0])
        else:
            torch.baddbmm(X, Bm, X, beta=a * s, alpha=s, out=Y)
        X, Y = Y, X
    return X
