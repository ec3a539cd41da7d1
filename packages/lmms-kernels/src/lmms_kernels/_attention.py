"""Variable-length (packed) attention with one signature and several backends.

All backends take packed tensors ``q [T, H, D]``, ``k/v [T, KV, D]`` plus int32 ``cu_seqlens``
(segment boundaries) and never let a token attend across a segment boundary. ``causal=True``
masks the future inside each segment (bottom-right aligned when a segment has more keys than
queries, as flash-attn does); ``causal=False`` is bidirectional (vision towers, diffusion LMs).

Backends, fastest first on an H200 (see docs/kernels.md and benchmarks/RESULTS.md):

- ``"fa4"``: flash-attn 4 (``flash_attn.cute``). Hopper/Blackwell only, bf16/fp16.
- ``"fa"``: flash-attn 2/3 (``flash_attn`` / ``flash_attn_interface``).
- ``"torch"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA only; KV heads are repeated when
  the installed torch has no ``enable_gqa``).
- ``"flex"``: FlexAttention with a document mask. Compiled on CUDA; the block mask is rebuilt
  for every new ``cu_seqlens`` (cached for the last few), which costs a host sync.
- ``"sdpa"``: a loop of ``scaled_dot_product_attention`` over segments. Any device, the CPU
  default and the reference the others are tested against. One small kernel per segment, so
  it is slow for many short segments on a GPU.

Under ``torch.compile`` every backend runs through one custom op with a fake and a backward
(``_attention_ops.py``): compiled blocks keep attention in their graph without a break.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from itertools import pairwise

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "available_backends", "resolve_backend", "varlen_attention"]

BACKENDS = ("fa4", "fa", "torch", "flex", "sdpa")

_INSTALL_HINT = {
    "fa4": "install flash-attn 4 (`pip install lmms-kernels[flash]` or `flash-attn-4`, module flash_attn.cute) and run on a CUDA GPU",
    "fa": "install flash-attn 2/3 (`pip install flash-attn`) and run on a CUDA GPU",
    "torch": "needs torch>=2.9 with torch.nn.attention.varlen and a CUDA GPU",
    "flex": "needs torch>=2.5 (torch.nn.attention.flex_attention)",
    "sdpa": "always available",
}


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _fa4_fn() -> Callable | None:
    if not _has_module("flash_attn"):
        return None
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


@functools.cache
def _fa_fn() -> Callable | None:
    for mod in ("flash_attn_interface", "flash_attn"):  # FA3 first, then FA2
        if not _has_module(mod):
            continue
        try:
            fn = getattr(importlib.import_module(mod), "flash_attn_varlen_func", None)
        except Exception:
            fn = None
        if fn is not None:
            return fn
    return None


@functools.cache
def _torch_varlen_fn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _flex_available() -> bool:
    return _has_module("torch.nn.attention.flex_attention")


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends usable on ``device`` (default: CUDA if present, else CPU), fastest first."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    out = []
    if cuda and _fa4_fn() is not None:
        out.append("fa4")
    if cuda and _fa_fn() is not None:
        out.append("fa")
    if cuda and _torch_varlen_fn() is not None:
        out.append("torch")
    if _flex_available():
        out.append("flex")
    out.append("sdpa")
    return out


# What "auto" resolved to per device type, recorded on the host by `resolve_backend`: compiled
# code reads it as a constant of the trace (resolving there would trace module lookups).
_AUTO: dict[str, str] = {}


#: backends whose kernels take 16-bit inputs only
_HALF_ONLY = frozenset({"fa4", "fa", "torch"})


def resolve_backend(
    backend: str, device: torch.device | str, dtype: torch.dtype | None = None
) -> str:
    """Map ``"auto"`` to the fastest backend for ``device``; check an explicit one is usable.

    Automatic choice: CUDA -> fa4, fa, torch, flex (first available); any other device -> sdpa.
    Inputs of another ``dtype`` than fp16/bf16 (an fp32 run on CUDA) take sdpa: the flash
    kernels refuse them.
    """
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {('auto', *BACKENDS)}"
        )
    avail = available_backends(device)
    if backend == "auto":
        kind = torch.device(device).type
        name = "sdpa" if kind != "cuda" else avail[0]
        if (
            dtype is not None
            and dtype not in (torch.float16, torch.bfloat16)
            and name in _HALF_ONLY
        ):
            return "sdpa"
        if _AUTO.get(kind) != name:  # written once: a compiled graph guards on this dict
            _AUTO[kind] = name
        return name
    if backend not in avail:
        raise RuntimeError(
            f"attention backend {backend!r} is not available on {device}: {_INSTALL_HINT[backend]}. "
            f"Available here: {avail}"
        )
    return backend


def varlen_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, KV, D]
    v: torch.Tensor,  # [Tk, KV, Dv]
    cu_seqlens_q: torch.Tensor,  # [n+1] int32
    cu_seqlens_k: torch.Tensor,  # [n+1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:  # [Tq, H, Dv]
    """Attention within each ``cu_seqlens`` segment, never across segments.

    ``H % KV == 0`` (grouped-query attention). q, k and v must share a dtype. Returns
    ``[Tq, H, Dv]`` in q's dtype. ``backend="auto"`` picks by device (see ``resolve_backend``).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"expected q [T, H, D], k/v [T, KV, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0 or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if torch.compiler.is_compiling():
        # One opaque custom op (``_attention_ops``): no graph break, no host read in the graph.
        # A 0-d tensor max length (Qwen-VL vision attention) becomes -1: the op's kernel reads
        # it from cu_seqlens on the host, as the eager path's ``int()`` does.
        d, dv = q.shape[-1], v.shape[-1]
        name = _AUTO.get(q.device.type) if backend == "auto" else backend
        pad = _fa4_pad_to(d, dv) if name == "fa4" else 0
        if pad:  # zero-padded here, so Inductor fuses the pads into q/k/v's producers
            softmax_scale = d**-0.5 if softmax_scale is None else softmax_scale
            q, k, v = F.pad(q, (0, pad - d)), F.pad(k, (0, pad - d)), F.pad(v, (0, pad - dv))
        out, _ = torch.ops.lmms_kernels.varlen_attn(
            q,
            k,
            v,
            cu_seqlens_q.to(device=q.device, dtype=torch.int32),
            cu_seqlens_k.to(device=q.device, dtype=torch.int32),
            -1 if isinstance(max_seqlen_q, torch.Tensor) else max_seqlen_q,
            -1 if isinstance(max_seqlen_k, torch.Tensor) else max_seqlen_k,
            causal,
            softmax_scale,
            backend,
        )
        return out[..., :dv] if pad else out
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    return _run_backend(backend, *args)


# Every distinct call this process made, by how it ran: ("op" | "eager", backend, query heads,
# key/value heads, head dim, value head dim, dtype, causal, softmax scale, device). A dict
# (ordered set) filled on the host per call; `lmms_kernels.warm_attention` replays them.
CALLS: dict[tuple, None] = {}


def record_call(path: str, name: str, q, k, v, causal: bool, scale) -> None:
    """Note one attention call's signature in :data:`CALLS` (a dict insert on the host)."""
    CALLS[(path, name, q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, bool(causal),
           scale, q.device)] = None  # fmt: skip


def _run_backend(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Eager path: resolve the backend and call its kernel (autograd through the kernel's own
    backward). ``max_q``/``max_k`` may be ints or 0-d tensors (one host read each)."""
    name = resolve_backend(backend, q.device, q.dtype)
    record_call("eager", name, q, k, v, causal, scale)
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    return _IMPLS[name](q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, scale)


# --------------------------------------------------------------------------- backends


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:  # [T, KV, D] -> [T, KV*n_rep, D]
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sdpa(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q has {len(bounds_q)} entries, cu_seqlens_k {len(bounds_k)}")
    outs = []
    for (a, b), (c, d) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True):
        lq, lk = b - a, d - c
        if lq == 0:
            continue
        qs = q[a:b].transpose(0, 1)  # [H, lq, D]
        ks, vs = k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)  # [H, lk, D]
        mask, is_causal = None, causal
        if causal and lq != lk:  # bottom-right aligned causal mask (flash-attn convention)
            iq = torch.arange(lq, device=q.device)[:, None]
            ik = torch.arange(lk, device=q.device)[None, :]
            mask, is_causal = ik <= iq + (lk - lq), False
        if lk == 0:
            outs.append(q.new_zeros(lq, q.shape[1], v.shape[-1]))
            continue
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=is_causal, scale=scale
        )
        outs.append(o.transpose(0, 1))
    if bounds_q[-1] != q.shape[0]:  # tokens after the last boundary belong to no segment
        outs.append(q.new_zeros(q.shape[0] - bounds_q[-1], q.shape[1], v.shape[-1]))
    if not outs:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)


def _unwrap(out):
    return out[0] if isinstance(out, tuple) else out


# Head dims FA4 (4.0.0b36, sm90) computes correctly in forward and backward. Measured on the H200
# (2026-12-02): head dim 80 (Qwen2.5-VL's vision tower) gave a wrong dq. Other dims are zero-padded
# up to the next of these: zeros in q/k leave every dot product unchanged, zeros in v give output
# columns that are sliced off, and the pads' gradients are dropped by the slice.
_FA4_HEAD_DIMS = (64, 128)


def _fa4_padded_dim(d: int, dv: int) -> int | None:
    return next((s for s in _FA4_HEAD_DIMS if s >= max(d, dv)), None)


def _fa4_pad(q, k, v):
    """Zero-pad head dims to one FA4 computes correctly; returns q, k, v and the pads of q/k
    and of v. Callers pass the unpadded softmax scale (FA4's default would use the padded dim)."""
    d, dv = q.shape[-1], v.shape[-1]
    padded = _fa4_padded_dim(d, dv)
    if padded is None or (d == padded and dv == padded):
        return q, k, v, 0, 0
    pq, pv = padded - d, padded - dv
    return F.pad(q, (0, pq)), F.pad(k, (0, pq)), F.pad(v, (0, pv)), pq, pv


def _fa4_pad_to(d: int, dv: int) -> int:
    """Head dim compiled code zero-pads q/k/v to before the custom op when it runs FA4 (0:
    none). Padding inside the op (eager) cost ~12 strided copies per Qwen2.5-VL vision block per
    step (head dim 80; 23 ms of a 16k step on the H200, 2026-12-03 profile); in the traced code
    Inductor writes the padded layout in the kernels that produce q/k/v, and the op's saved
    tensors and gradients are already padded."""
    padded = _fa4_padded_dim(d, dv)
    return 0 if padded is None or (d == padded and dv == padded) else padded


def _fa4_call(fn, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, **kw):
    """``fn`` (an FA4 varlen forward) on q/k/v padded to the head dim FA4 needs; the scale is
    that of the unpadded head dim. The caller cuts the output back to ``v.shape[-1]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, _, _ = _fa4_pad(q, k, v)
    return fn(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=causal,
        **kw,
    )


def _fa4(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    out = _fa4_call(_fa4_fn(), q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    return _unwrap(out)[..., : v.shape[-1]]


def _fa(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    fn = _fa_fn()
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)
    return _unwrap(out)


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen_fn()).parameters)


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    fn, params = _torch_varlen_fn(), _torch_varlen_params()
    kw = {}
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    else:
        n_rep = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    if "window_size" in params:  # torch >= 2.10
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:  # torch 2.9
        kw["is_causal"] = causal
    elif causal:
        raise RuntimeError("this torch's varlen_attn supports neither window_size nor is_causal")
    if scale is not None and "scale" in params:
        kw["scale"] = scale
    elif scale is not None:  # no scale argument: fold it into q (default scale is D**-0.5)
        q = q * (scale * q.shape[-1] ** 0.5)
    return _unwrap(fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw))


# FlexAttention ------------------------------------------------------------------


@functools.cache
def _flex_fn(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def _doc_ids(cu: torch.Tensor, total: int) -> torch.Tensor:  # [total] segment index per token
    pos = torch.arange(total, device=cu.device, dtype=torch.int32)
    # tokens past cu[-1] get id n (their own segment)
    return torch.searchsorted(cu[1:].contiguous(), pos, right=True)


_BLOCK_MASK_CACHE: dict[tuple, object] = {}


def _flex_block_mask(cu_q, cu_k, tq, tk, causal, device):
    from torch.nn.attention.flex_attention import create_block_mask

    key = (tuple(cu_q.tolist()), tuple(cu_k.tolist()), tq, tk, causal, str(device))
    hit = _BLOCK_MASK_CACHE.get(key)
    if hit is not None:
        return hit
    doc_q, doc_k = _doc_ids(cu_q, tq), _doc_ids(cu_k, tk)
    doc_k = torch.where(
        doc_k == len(cu_k) - 1, doc_k + 1, doc_k
    )  # keys past cu_k[-1]: seen by none
    start_q, start_k = (
        cu_q.long()[doc_q.clamp(max=len(cu_q) - 1)],
        cu_k.long()[doc_k.clamp(max=len(cu_k) - 1)],
    )
    # length of each segment, to align causal masks bottom-right when lq != lk
    len_q = torch.diff(cu_q.long(), append=cu_q.new_tensor([tq]).long())
    len_k = torch.diff(cu_k.long(), append=cu_k.new_tensor([tk]).long())
    offset = (len_k - len_q)[doc_q.clamp(max=len(cu_q) - 1)]  # [tq]

    def mask_mod(b, h, qi, ki):
        same = doc_q[qi] == doc_k[ki]
        if not causal:
            return same
        return same & (ki - start_k[ki] <= qi - start_q[qi] + offset[qi])

    bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=tq, KV_LEN=tk, device=device)
    if len(_BLOCK_MASK_CACHE) >= 8:
        _BLOCK_MASK_CACHE.pop(next(iter(_BLOCK_MASK_CACHE)))
    _BLOCK_MASK_CACHE[key] = bm
    return bm


def _flex(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    tq, tk = q.shape[0], k.shape[0]
    bm = _flex_block_mask(cu_q, cu_k, tq, tk, causal, q.device)
    compiled = q.device.type == "cuda"
    fn = _flex_fn(compiled)
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
    gqa = q.shape[1] != k.shape[1]
    with warnings.catch_warnings():
        if not compiled:  # eager flex (CPU) warns that it is unfused: expected for a reference
            warnings.filterwarnings(
                "ignore", message=".*flex_attention called without torch.compile.*"
            )
        out = fn(qb, kb, vb, block_mask=bm, scale=scale, enable_gqa=gqa)
    out = out[0].transpose(0, 1)  # [T, H, D]
    # rows with no visible key (tokens past cu[-1] under a segment with no keys) come out as 0/NaN
    return torch.nan_to_num(out) if tq != int(cu_q[-1]) else out


_IMPLS: dict[str, Callable] = {
    "fa4": _fa4,
    "fa": _fa,
    "torch": _torch_varlen,
    "flex": _flex,
    "sdpa": _sdpa,
}
