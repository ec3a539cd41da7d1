"""One launch for every parameter of a group: :class:`lmms_optim.LowPrecisionAdamW`'s fused path.

The per-parameter kernel (:mod:`lmms_optim._lowp_triton`) costs a Python call, host checks and a
Triton launch per parameter: ~800 per step for Qwen2.5-VL-3B (norm weights and biases included),
on the host while the device waits at the end of backward. Here one kernel steps every parameter
of a group: a table of addresses (parameter, moments, low-precision mirror: built once, the
tensors do not move) and one of the step's gradient addresses and seeds (one host-to-device
copy per step), one program per chunk of 8192 elements. With ``lmms_parallel.MasterWeights``
the kernel also writes the bf16 compute weight from the new fp32 master (what the masters'
separate copy pass did): per parameter it reads the fp32 master, the bf16 gradient and both
bf16 moments and writes the master, the moments and the bf16 weight, 20 bytes in all.

Elements are computed and rounded exactly as the per-parameter kernel does (same formula, the
same Philox streams from the parameter's seed and the element's index), so the two paths agree
bit for bit (tested under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from . import _lowp_triton
from ._flat_adamw import Hyper

__all__ = ["MultiPack", "lowp_adamw_multi_"]

tl: Any = None  # triton.language, bound by _multi_kernel() on first use
_sr: Any = None  # _lowp_triton's rounding helper, bound likewise (the interpreter reads globals)
_address: Any = None  # the kernel's pointer helper, bound likewise
_adamw: Any = None  # and its AdamW step helper
_BLOCK = 1024
# ---------------------------------------------------------------- every parameter in one launch
#: elements per program of the one-launch kernel (a parameter is cut into chunks of this size)
_CHUNK = 8192


class MultiPack:
    """The static half of :func:`lowp_adamw_multi_`'s tables for one list of parameters: the
    addresses of each parameter, its moments and its low-precision mirror (``[4, P]`` int64),
    the element counts (``[P]``) and the chunks (parameter index ``[C]`` int32, first element
    ``[C]`` int64), built once on the parameters' device. The tensors must stay where they are
    (the optimizer's state and the masters do)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        mirrors: list[torch.Tensor] | None,
    ) -> None:
        groups = [params, exp_avgs, exp_avg_sqs] + ([mirrors] if mirrors is not None else [])
        for tensors in groups:
            if len({t.dtype for t in tensors}) != 1 or not all(t.is_contiguous() for t in tensors):
                raise ValueError("MultiPack: contiguous tensors of one dtype per role")
        for row in zip(*groups, strict=True):
            if len({t.numel() for t in row}) != 1 or len({t.device for t in row}) != 1:
                raise ValueError("MultiPack: a parameter's tensors differ in size or device")
        self.tensors = groups  # kept alive: the tables hold their addresses
        self.dtypes = tuple(t[0].dtype for t in groups)
        device = params[0].device
        addresses = [[t.data_ptr() for t in ts] for ts in groups]
        if mirrors is None:
            addresses.append(addresses[0])  # never read (HAS_OUT off)
        self.static = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.numel = torch.tensor([p.numel() for p in params], dtype=torch.int64, device=device)
        index, start = [], []
        for i, p in enumerate(params):
            for s in range(0, p.numel(), _CHUNK):
                index.append(i)
                start.append(s)
        self.chunk_index = torch.tensor(index, dtype=torch.int32, device=device)
        self.chunk_start = torch.tensor(start, dtype=torch.int64, device=device)
        self.count = len(params)


def lowp_adamw_multi_(
    pack: MultiPack,
    grads: list[torch.Tensor],  # one per parameter of the pack, contiguous, one dtype
    seeds: list[int],  # one per parameter, 0 <= seed < 2**31
    hp: Hyper,
    *,
    stochastic: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """:func:`lowp_adamw_triton_` on every parameter of ``pack`` in one kernel launch, with the
    updated parameter also written to its mirror (bf16, rounded to nearest) when the pack has
    mirrors. Each element is computed and rounded exactly as the per-parameter kernel does
    (the same Philox streams: seed and element index), so the two agree bit for bit. The
    gradients' addresses and the seeds travel in one host-to-device copy per call."""
    if len(grads) != pack.count or len(seeds) != pack.count:
        raise ValueError(f"{pack.count} parameters, {len(grads)} gradients, {len(seeds)} seeds")
    p_dt, s_dt = pack.dtypes[0], pack.dtypes[1]
    if pack.dtypes[2] != s_dt or len({g.dtype for g in grads}) != 1:
        raise ValueError("lowp_adamw_multi_: one moment dtype and one gradient dtype")
    if pack.chunk_index.numel() == 0:  # every tensor empty (an FSDP2 rank's small shards)
        return
    device = pack.static.device
    host = torch.tensor([[g.data_ptr() for g in grads], seeds], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    dynamic = host.to(device, non_blocking=True)
    kernel = _multi_kernel()
    bf16 = torch.bfloat16
    for t in (*pack.dtypes, grads[0].dtype):
        if t not in (torch.float32, bf16):
            raise ValueError(f"lowp_adamw_multi_: fp32 or bf16 tensors, got {t}")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(pack.chunk_index.numel(),)](
            pack.static, dynamic, pack.numel, pack.chunk_index, pack.chunk_start,
            pack.numel if grad_scale is None else grad_scale, pack.count,
            *hp.kernel_scalars(),
            HAS_SCALE=grad_scale is not None, HAS_OUT=len(pack.dtypes) == 4,
            P_SR=stochastic and p_dt == bf16, S_SR=stochastic and s_dt == bf16,
            P_BF16=p_dt == bf16, G_BF16=grads[0].dtype == bf16, S_BF16=s_dt == bf16,
            O_BF16=pack.dtypes[-1] == bf16, CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip


@functools.cache
def _multi_kernel() -> Callable:
    """The one-launch kernel (built on first use, like :func:`_kernel`)."""
    global tl, _sr, _adamw, _address
    import triton
    import triton.language as tl

    _lowp_triton._kernel()  # binds its helpers: the AdamW step and the rounding
    _sr, _adamw = _lowp_triton._sr, _lowp_triton._adamw

    @triton.jit
    def _address(table_ptr, i, BF16: tl.constexpr):
        # a pointer of the row's dtype, from literal dtypes as Triton's grouped-GEMM tutorial
        # does (a dtype passed as a constexpr worked in the interpreter; not tried on a GPU)
        if BF16:
            return tl.load(table_ptr + i).to(tl.pointer_type(tl.bfloat16))
        else:
            return tl.load(table_ptr + i).to(tl.pointer_type(tl.float32))

    @triton.jit
    def _lowp_adamw_multi_kernel(
        static_ptr, dynamic_ptr, numel_ptr, chunk_index_ptr, chunk_start_ptr, scale_ptr, n_params,
        decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size,
        HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, P_SR: tl.constexpr, S_SR: tl.constexpr,
        P_BF16: tl.constexpr, G_BF16: tl.constexpr, S_BF16: tl.constexpr, O_BF16: tl.constexpr,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0)
        i = tl.load(chunk_index_ptr + c)
        start = tl.load(chunk_start_ptr + c)
        end = tl.minimum(start + CHUNK, tl.load(numel_ptr + i))
        p_ptr = _address(static_ptr, i, P_BF16)
        m_ptr = _address(static_ptr + n_params, i, S_BF16)
        v_ptr = _address(static_ptr + 2 * n_params, i, S_BF16)
        o_ptr = _address(static_ptr + 3 * n_params, i, O_BF16)
        g_ptr = _address(dynamic_ptr, i, G_BF16)
        seed = tl.load(dynamic_ptr + n_params + i)
        for base in range(start, end, BLOCK):
            offs = base + tl.arange(0, BLOCK)
            mask = offs < end
            p, m, v = _adamw(
                p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, scale_ptr,
                decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                step_size, HAS_SCALE,
            )  # fmt: skip
            if P_SR or S_SR:  # the per-parameter kernel's streams: 32-bit element index
                r0, r1, r2, _r3 = tl.randint4x(seed.to(tl.int32), offs.to(tl.int32))
                if P_SR:
                    p = _sr(p, r0.to(tl.int32, bitcast=True))
                if S_SR:
                    m = _sr(m, r1.to(tl.int32, bitcast=True))
                    v = _sr(v, r2.to(tl.int32, bitcast=True))
            tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
            tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
            tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
            if HAS_OUT:
                tl.store(o_ptr + offs, p.to(o_ptr.dtype.element_ty), mask=mask)

    return _lowp_adamw_multi_kernel
