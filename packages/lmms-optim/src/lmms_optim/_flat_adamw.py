"""One fused AdamW pass over flat fp32 buffers: clip, update and bf16 write-back in one kernel.

A one-GPU trainer with master weights keeps every fp32 master parameter as a view into one flat
fp32 buffer and its bf16 compute copy as a view into one flat bf16 buffer at the same element
offsets (each view 64-element aligned, zero padding between views). With the master gradients
and the AdamW states laid out the same way, its optimizer step is three passes over memory
today: the clip multiply (``_foreach_mul_``), torch's fused AdamW, and one fp32 → bf16 copy of
the whole flat buffer. :func:`flat_adamw_` does all three in one pass: the gradient is
multiplied by the clip coefficient (a device scalar, never read on the host) as it is loaded,
and the updated master is rounded to bf16 and stored as it is written.

The ranges to update come from :func:`segment_chunks`, built once per parameter group: every
parameter ``(offset, numel)`` cut into chunks, so padding gaps (and parameters of other groups,
with other hyper-parameters) are never touched. The Triton kernel runs one program per chunk.

Per element, with ``g = grad.float() * grad_scale`` (``torch.optim.AdamW``'s decoupled decay)::

    p = p * (1 - lr * weight_decay)
    m = m.lerp(g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    p = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
    out = bf16(p)

The ``"torch"`` backend runs exactly torch's single-tensor AdamW ops (``foreach=False``) on the
contiguous runs of chunks: the CPU path and the reference. The ``"triton"`` backend computes the
same formula in fp32 registers with IEEE-rounded ``sqrt`` and division; FMA contraction and
operation order make it differ from torch's kernels by a few fp32 ulps, like torch's own fused
AdamW does.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

__all__ = ["flat_adamw_", "segment_chunks"]

Backend = Literal["auto", "torch", "triton"]

tl: Any = None  # triton.language and the kernel's helper, bound by _kernel() on first use
_window: Any = None
_BLOCK = 1024  # elements per Triton loop iteration (4 warps × 32 threads × 8)
_NUM_WARPS = 4


def segment_chunks(
    segments: Sequence[tuple[int, int]], block: int, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """``(starts, ends)``: int64 tensors on ``device``, one entry per chunk (``end`` exclusive).

    Every segment ``(offset, numel)`` of a flat buffer is cut at the multiples of ``block`` (in
    flat-buffer coordinates), so chunks hold at most ``block`` elements and all but a segment's
    first begin block-aligned. With ``block`` a multiple of 1024 (the kernel's window) a chunk
    edge falls inside a window only at a segment's ends: only those windows take the masked,
    unvectorised path. 8192 is a reasonable ``block`` (not benchmarked yet): fewer, longer
    programs amortise the loads of their bounds. Empty segments are dropped; chunks come out
    sorted by offset. Built once per parameter group and reused every step.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    starts: list[Tensor] = []
    ends: list[Tensor] = []
    prev_end, prev = 0, None
    for offset, numel in sorted((int(o), int(n)) for o, n in segments):
        if offset < 0 or numel < 0:
            raise ValueError(f"segment (offset={offset}, numel={numel}) must be non-negative")
        if numel == 0:
            continue
        if prev is not None and offset < prev_end:
            raise ValueError(f"segments overlap: {prev} and {(offset, numel)}")
        end = offset + numel
        cuts = torch.arange(min((offset // block + 1) * block, end), end, block)
        starts.append(torch.cat([torch.tensor([offset]), cuts]))
        ends.append(torch.cat([cuts, torch.tensor([end])]))
        prev_end, prev = end, (offset, numel)
    if not starts:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty.clone()
    return torch.cat(starts).to(device), torch.cat(ends).to(device)


def flat_adamw_(
    master: Tensor,  # [N] fp32, updated in place
    grad: Tensor,  # [N] fp32 or bf16, read only
    exp_avg: Tensor,  # [N] fp32, updated in place
    exp_avg_sq: Tensor,  # [N] fp32, updated in place
    chunks: tuple[Tensor, Tensor],  # ([C], [C]) int64 from segment_chunks
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: Tensor | None = None,  # [] fp32
    out: Tensor | None = None,  # [N] bf16
    backend: Backend = "auto",
) -> None:
    """One AdamW step on the chunk ranges of flat buffers, in place (see the module docstring).

    Called from a master-weights optimizer step: it replaces the clip multiply, the AdamW update
    and the fp32 → bf16 write-back (three passes over memory) by one. ``step`` is the step
    number after its increment (1 on the first step): it sets the bias corrections.
    ``grad_scale`` (a 0-d fp32 tensor on the buffers' device, e.g. the clip coefficient)
    multiplies the gradient inside the kernel, without a host sync; ``None`` means 1. ``out``
    (bf16) receives the updated master rounded to nearest-even, on the same ranges only.

    ``backend``: ``"triton"`` (one kernel, one program per chunk; CUDA, or CPU under
    ``TRITON_INTERPRET=1`` for tests), ``"torch"`` (torch's single-tensor AdamW ops on each run of
    contiguous chunks: bitwise equal to ``torch.optim.AdamW(foreach=False)`` stepping the
    parameters one by one, as tested on CPU; reads the chunk bounds on the host) or ``"auto"`` (Triton on CUDA
    when it imports, torch elsewhere). The Triton kernel trusts the chunk bounds (they are not
    read on the host): build them with :func:`segment_chunks` from segments inside the buffers.
    """
    bufs = Flat(master, grad, exp_avg, exp_avg_sq, chunks, grad_scale, out)
    _check_buffers(bufs)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")
    if step < 1:
        raise ValueError(f"step is counted after its increment and must be >= 1, got {step}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    use_triton = backend == "triton" or (
        backend == "auto" and master.is_cuda and _triton_usable(master)
    )
    if use_triton and not _triton_usable(master):
        raise RuntimeError(
            "backend='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1 for CPU "
            "tests); use backend='torch' here"
        )
    step_fn = _step_triton if use_triton else _step_torch
    hp = Hyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    step_fn(bufs, hp)


def _check_buffers(bufs: Flat) -> None:
    master, grad, exp_avg, exp_avg_sq, chunks, grad_scale, out = bufs
    flats = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        flats["out"] = out
    allowed = {
        "master": (torch.float32,),
        "grad": (torch.float32, torch.bfloat16),
        "exp_avg": (torch.float32,),
        "exp_avg_sq": (torch.float32,),
        "out": (torch.bfloat16,),
    }
    for name, t in flats.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in allowed[name]:
            names = " or ".join(str(d) for d in allowed[name])
            raise TypeError(f"{name} must be {names}, got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
        if t.numel() != master.numel():
            raise ValueError(f"{name} has {t.numel()} elements, master has {master.numel()}")
        if t.device != master.device:
            raise ValueError(f"{name} is on {t.device}, master on {master.device}")
    if grad_scale is not None:
        if not isinstance(grad_scale, Tensor) or grad_scale.dim() != 0:
            raise ValueError("grad_scale must be a 0-d tensor (or None)")
        if grad_scale.dtype != torch.float32 or grad_scale.device != master.device:
            raise ValueError(
                f"grad_scale must be fp32 on {master.device}, "
                f"got {grad_scale.dtype} on {grad_scale.device}"
            )
    if not (isinstance(chunks, tuple | list) and len(chunks) == 2):
        raise TypeError("chunks must be the (starts, ends) pair from segment_chunks")
    starts, ends = chunks
    for name, t in (("starts", starts), ("ends", ends)):
        if not isinstance(t, Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"chunk {name} must be a 1-D int64 tensor (from segment_chunks)")
        if t.device != master.device:
            raise ValueError(
                f"chunk {name} is on {t.device}, master on {master.device}: "
                "build them with segment_chunks(..., device=master.device)"
            )
        if not t.is_contiguous():
            raise ValueError(f"chunk {name} must be contiguous")
    if starts.numel() != ends.numel():
        raise ValueError(f"{starts.numel()} chunk starts but {ends.numel()} chunk ends")


def _triton_usable(t: Tensor) -> bool:
    if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Flat(NamedTuple):
    """The flat buffers of one AdamW step (shapes and dtypes: :func:`flat_adamw_`)."""

    master: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    chunks: tuple[Tensor, Tensor]
    grad_scale: Tensor | None = None
    out: Tensor | None = None


@dataclass(frozen=True, slots=True)
class Hyper:
    """One step's AdamW hyper-parameters (``step`` counted after its increment)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    def kernel_scalars(self) -> tuple[float, ...]:
        """What the Triton AdamW kernels take: decay, 1 - beta1, beta2, 1 - beta2, the square
        root of the second bias correction, eps and the step size."""
        bc1, bc2 = 1 - self.beta1**self.step, 1 - self.beta2**self.step
        decay, step_size = 1 - self.lr * self.weight_decay, self.lr / bc1
        return decay, 1 - self.beta1, self.beta2, 1 - self.beta2, bc2**0.5, self.eps, step_size


def _step_torch(bufs: Flat, hp: Hyper) -> None:
    """torch's ``_single_tensor_adam`` (decoupled decay), op for op, on each contiguous run."""
    master, grad, exp_avg, exp_avg_sq, chunks, grad_scale, out = bufs
    lr, beta1, beta2, eps, weight_decay, step = (
        hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.step
    )  # fmt: skip
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    for lo, hi in _runs(chunks, master.numel()):
        p, m, v = master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        g = grad[lo:hi].float()  # a view when grad is already fp32
        if grad_scale is not None:
            g = g * grad_scale
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if out is not None:
            out[lo:hi].copy_(p)


def _runs(chunks: tuple[Tensor, Tensor], numel: int) -> list[tuple[int, int]]:
    """The chunk ranges with back-to-back neighbours merged (one host read of the bounds),
    checked before anything is written."""
    starts, ends = (t.tolist() for t in chunks)
    runs: list[tuple[int, int]] = []
    for lo, hi in sorted(zip(starts, ends, strict=True)):
        if lo < 0 or hi > numel:
            raise ValueError(f"chunk [{lo}, {hi}) lies outside the buffers of {numel} elements")
        if hi <= lo:
            continue
        if runs and lo < runs[-1][1]:
            raise ValueError(f"chunks overlap at [{lo}, {hi})")
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return runs


def _step_triton(bufs: Flat, hp: Hyper) -> None:
    master, grad, exp_avg, exp_avg_sq, chunks, grad_scale, out = bufs
    starts, ends = chunks
    if starts.numel() == 0:
        return
    kernel = _kernel()
    # absent optional pointers get a harmless stand-in: the constexpr flags keep them unread;
    # Triton launches on the current device, so make it the buffers'
    with torch.cuda.device(master.device) if master.is_cuda else contextlib.nullcontext():
        kernel[(starts.numel(),)](
            master, grad, exp_avg, exp_avg_sq,
            master if out is None else out,
            master if grad_scale is None else grad_scale,
            starts, ends,
            *hp.kernel_scalars(),
            HAS_SCALE=grad_scale is not None, HAS_OUT=out is not None,
            BLOCK=_BLOCK, num_warps=_NUM_WARPS,
        )  # fmt: skip


@functools.cache
def _kernel() -> Callable:
    """The Triton kernel, built on first use: importing lmms_optim does not import triton.

    ``tl`` and the helper are bound as module globals, not closures: Triton's interpreter
    (``TRITON_INTERPRET=1``) resolves a kernel's names in its module's globals only.
    """
    global tl, _window
    import triton
    import triton.language as tl

    @triton.jit
    def _window(
        p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, mask, scale,
        decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size,
        HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr,
    ):  # fmt: skip
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        if HAS_SCALE:
            g = g * scale
        p = p * decay
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights < 0.5
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(tl.bfloat16), mask=mask)

    @triton.jit
    def _flat_adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr,  # flat [N]; scale: [] fp32
        starts_ptr, ends_ptr,  # [C] int64: one program per chunk
        decay, one_minus_beta1, beta2, one_minus_beta2,
        bias_correction2_sqrt, eps, step_size,  # host floats: a new lr does not recompile
        HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        start = tl.load(starts_ptr + pid)
        end = tl.load(ends_ptr + pid)
        scale = tl.load(scale_ptr) if HAS_SCALE else 1.0
        # BLOCK-aligned windows: the ones inside [start, end) load unmasked (vectorised), the
        # chunk's ragged ends masked
        for base in range((start // BLOCK) * BLOCK, end, BLOCK):
            offs = tl.multiple_of(base, BLOCK) + tl.arange(0, BLOCK)
            if (base >= start) & (base + BLOCK <= end):
                _window(
                    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, None, scale,
                    decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                    step_size, HAS_SCALE, HAS_OUT,
                )  # fmt: skip
            else:
                _window(
                    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, (offs >= start) & (offs < end),
                    scale, decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt,
                    eps, step_size, HAS_SCALE, HAS_OUT,
                )  # fmt: skip

    return _flat_adamw_kernel
