"""Packing-exact linear attention: the gated delta rule and the short causal convolution over the
segments of a packed row (``cu_seqlens``), so no recurrent state and no convolution window ever
crosses from one sample into the next.

Two backends, one contract:

* ``"fla"``: flash-linear-attention's varlen Triton kernels (``chunk_gated_delta_rule`` and
  ``causal_conv1d`` with ``cu_seqlens``); CUDA only (Triton), installed with the ``fla`` extra
  (``pip install 'lmms-models[fla]'`` or ``'lmms-kernels[fla]'``).
* ``"torch"``: the plain-torch reference, any device. The convolution is one masked shifted sum
  per tap (a tap that would read across a segment start reads zero); the delta rule lays every
  segment out from a chunk boundary (zero padding to whole chunks: ``k = 0, beta = 0, g = 0``
  leaves the state as it was), solves all chunks' intra-chunk systems at once, and scans the
  chunks of all segments together, each segment from a zero state.

``"auto"`` takes ``"fla"`` for CUDA tensors when flash-linear-attention imports, else ``"torch"``.

On the fla path the pack's ``cu_seqlens`` reaches the kernels as one int64 tensor per pack (the
same object for every layer's calls, so fla's identity cache of its chunk indices reads the
lengths on the host once per pack, not once per call). Under ``torch.compile`` both ops are
custom ops (``_linear_ops.py``): no graph break, neither backend's Python traced.

Shapes follow the packed row (no batch dimension): ``q/k [T, Hk, Dk]``, ``v [T, Hv, Dv]``,
``g/beta [T, Hv]`` (``Hv % Hk == 0``: grouped value heads, each q/k head serving ``Hv / Hk``
consecutive value heads), ``cu_seqlens [n+1]`` int32 with ``cu_seqlens[-1] == T``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "LINEAR_BACKENDS",
    "causal_conv1d_varlen",
    "gated_delta_rule_varlen",
    "gated_rms_norm",
    "resolve_linear_backend",
]

LINEAR_BACKENDS = ("auto", "torch", "fla")
_FLA_HINT = (
    "flash-linear-attention is not installed: pip install 'lmms-models[fla]' "
    "(or 'lmms-kernels[fla]'); its kernels need a CUDA GPU"
)


@functools.cache
def _fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _fla() -> Any:
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise ImportError(_FLA_HINT) from e
    return chunk_gated_delta_rule, causal_conv1d


#: (pack cu_seqlens, its int64 copy on the kernels' device) of the last few packs
_FLA_CU: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque(maxlen=4)


def _fla_cu(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu`` as the int64 tensor fla's kernels take on ``device``: the same object for the same
    ``cu``, so fla's identity-keyed caches (chunk indices, offsets) hit after the first call."""
    for src, out in _FLA_CU:
        if src is cu and out.device == device:
            return out
    out = cu.to(device, torch.long)
    _FLA_CU.append((cu, out))
    return out


def _fla_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu: torch.Tensor, act: Any
) -> torch.Tensor:
    _, conv = _fla()
    y, _ = conv(x=x[None], weight=weight, bias=bias, activation=act, backend="triton",
                cu_seqlens=_fla_cu(cu, x.device))  # fmt: skip
    return y[0]


def _fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    qk_l2norm: bool,
) -> torch.Tensor:
    chunk, _ = _fla()
    o, _ = chunk(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=scale,
                 use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=_fla_cu(cu, q.device))  # fmt: skip
    return o[0].to(v.dtype)


def resolve_linear_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"fla"`` for ``backend`` on ``device`` (``"auto"``: fla on CUDA if present)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear-attention backend {backend!r}; one of {LINEAR_BACKENDS}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if not _fla_available():
            warnings.warn(
                f"{_FLA_HINT}; the plain-torch linear attention runs instead (exact, much slower)",
                stacklevel=3,
            )
            return "torch"
        return "fla"
    if backend == "fla":
        if device.type != "cuda":
            raise ValueError("backend='fla' runs Triton kernels and needs CUDA tensors")
        if not _fla_available():
            _fla()  # raises the ImportError naming the extra
    return backend


def _segment_positions(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's offset inside its segment: ``[T]`` long."""
    cu = cu.to(torch.long)
    idx = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu[1:], idx, right=True)  # [T] segment id
    return idx - cu[seg]


def causal_conv1d_varlen(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K] depthwise taps, the last one on the current token
    bias: torch.Tensor | None,  # [C]
    cu_seqlens: torch.Tensor,  # [n+1] int32
    *,
    activation: str | None = "silu",
    backend: str = "auto",
) -> torch.Tensor:  # [T, C]
    """Depthwise causal convolution restarted at every segment (its window never reads the
    previous sample): ``y[t] = act(b + Σ_j w[:, j] · x[t - (K-1) + j])`` over taps inside the
    segment of ``t``. Same taps as ``nn.Conv1d(groups=C, padding=K-1)`` truncated to ``T``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if torch.compiler.is_compiling():  # opaque to the compiler (lmms_kernels._linear_ops)
        return torch.ops.lmms_kernels.conv1d_varlen(
            x, weight, bias, cu_seqlens, activation, backend
        )
    be = resolve_linear_backend(backend, x.device)
    if be == "fla":
        return _fla_conv(x, weight, bias, cu_seqlens, activation)
    total, kernel = x.shape[0], weight.shape[1]
    pos = _segment_positions(cu_seqlens.to(x.device), total)  # [T]
    w = weight.to(x.dtype)
    out = x * w[:, kernel - 1]  # tap on the current token (always inside the segment)
    for shift in range(1, kernel):
        prev = F.pad(x, (0, 0, shift, 0))[:total]  # x[t - shift]
        keep = (pos >= shift).to(x.dtype)[:, None]  # [T, 1]: zero where it would cross a start
        out = out + prev * keep * w[:, kernel - 1 - shift]
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out if activation is None else F.silu(out)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_varlen(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv] write strength
    cu_seqlens: torch.Tensor,  # [n+1] int32
    *,
    scale: float | None = None,
    qk_l2norm: bool = True,
    chunk_size: int = 64,
    backend: str = "auto",
) -> torch.Tensor:  # [T, Hv, Dv], dtype of v
    """The gated delta rule over every segment, state zero at each segment start.

    Per value head, with ``S`` the ``[Dk, Dv]`` state: ``S_t = e^{g_t} S_{t-1} + k_t ·
    (β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t))ᵀ`` and ``o_t = S_tᵀ q_t · scale`` (``scale`` default
    ``Dk^-0.5``; q and k L2-normalised first when ``qk_l2norm``), in the chunked (WY) form.
    """
    if v.shape[1] % k.shape[1]:
        raise ValueError(
            f"value heads ({v.shape[1]}) must be a multiple of key heads ({k.shape[1]})"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.compiler.is_compiling():  # opaque to the compiler (lmms_kernels._linear_ops)
        return torch.ops.lmms_kernels.delta_rule_varlen(
            q, k, v, g, beta, cu_seqlens, float(scale), qk_l2norm, chunk_size, backend
        )
    be = resolve_linear_backend(backend, q.device)
    if be == "fla":
        return _fla_delta_rule(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm)
    return _gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens, scale, qk_l2norm, chunk_size)


def _chunk_layout(cu: torch.Tensor, total: int, chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Slot of every token when each segment starts on a chunk boundary, and each segment's
    number of chunks (consecutive, in order). Reads the (small) ``cu_seqlens`` on the host."""
    bounds = [int(b) for b in cu.tolist()]
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, the row has {total} tokens")
    slots, counts, n_chunks = [], [], 0
    for a, b in itertools.pairwise(bounds):
        n = -(-(b - a) // chunk)
        slots.append(torch.arange(b - a) + n_chunks * chunk)
        counts.append(n)
        n_chunks += n
    return torch.cat(slots), counts


def _gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    qk_l2norm: bool,
    chunk: int,
) -> torch.Tensor:
    out_dtype = v.dtype
    total, heads, dv = v.shape
    if k.shape[1] != heads:
        rep = heads // k.shape[1]
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    slots, counts = _chunk_layout(cu, total, chunk)
    slots = slots.to(q.device)
    n_chunks = sum(counts)
    n_slots = n_chunks * chunk

    def laid(t: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, N, C, ...]
        buf = t.new_zeros((n_slots, *t.shape[1:])).index_copy(0, slots, t)
        buf = buf.reshape(n_chunks, chunk, *t.shape[1:])
        return buf.permute(2, 0, 1, *range(3, buf.ndim))

    q, k, v, g, beta = laid(q), laid(k), laid(v), laid(g), laid(beta)  # [H, N, C(, D)]
    gc = g.cumsum(-1)  # [H, N, C] decay from the chunk start, log space
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # i >= j
    diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # [H, N, C, C] e^{gc_i - gc_j} for i >= j, else 0
    kb = k * beta[..., None]
    # (I + A) with A strictly lower: A_ij = β_i k_i·k_j e^{gc_i-gc_j}; its inverse is the WY form.
    # The unit-triangular solves read only the strictly lower part (the diagonal is taken as 1).
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * gc.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C] intra-chunk, diagonal included
    q_read = q * gc.exp()[..., None]  # reads the state entering the chunk
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # decayed to the chunk end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    # The scan in waves: wave j carries the j-th chunk of every segment that long at once, the
    # first from a zero state (nothing crosses a segment start), so a pack of many short samples
    # takes as many steps as its longest sample has chunks. ``state``: [H, m, Dk, Dv] of the m
    # segments of the current wave.
    firsts = list(itertools.accumulate([0, *counts[:-1]]))
    active = [i for i, n in enumerate(counts) if n]
    state: torch.Tensor | None = None
    order, outs = [], []
    for j in itertools.count():
        ids = torch.tensor([firsts[i] + j for i in active], device=q.device)
        u_j, attn_j = u.index_select(1, ids), attn.index_select(1, ids)  # [H, m, C, ...]
        if state is None:
            v_new = u_j
            outs.append(attn_j @ v_new)  # [H, m, C, Dv]
        else:
            v_new = u_j - w.index_select(1, ids) @ state
            outs.append(q_read.index_select(1, ids) @ state + attn_j @ v_new)
        order.append(ids)
        still = [p for p, i in enumerate(active) if counts[i] > j + 1]
        if not still:
            break
        state_end = k_write.index_select(1, ids).transpose(-1, -2) @ v_new  # [H, m, Dk, Dv]
        if state is not None:
            state_end = state_end + state * chunk_decay.index_select(1, ids)
        state = state_end.index_select(1, torch.tensor(still, device=q.device))
        active = [active[p] for p in still]
    o = torch.cat(outs, 1).index_select(1, torch.argsort(torch.cat(order)))  # [H, N, C, Dv]
    o = o.reshape(heads, n_slots, dv).transpose(0, 1)  # [N*C, H, Dv]
    return o.index_select(0, slots).to(out_dtype)  # [T, H, Dv]


def gated_rms_norm(
    x: torch.Tensor,  # [..., D]
    gate: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    activation: str = "silu",
) -> torch.Tensor:
    """``rmsnorm(x) · weight · act(gate)`` in fp32, returned in ``x``'s dtype (norm before gate)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    act = torch.sigmoid if activation == "sigmoid" else F.silu
    return (y * act(gate.float())).to(x.dtype)
