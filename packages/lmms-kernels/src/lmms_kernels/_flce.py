"""Fused linear + cross-entropy: ``sum CE(hidden @ W.T + b, labels)`` without ``[T, V]`` logits.

Three implementations with the same result:

- ``"liger"``: Liger-Kernel's Triton kernel (CUDA, ``pip install lmms-kernels[liger]``). It
  reads device values on the host three times per call (a
  ``.item()`` in forward, a ``torch.equal`` against a fresh device scalar in backward), works in
  256-token chunks and accumulates the weight gradient in bf16 (~63-67 ms fwd+bwd at T=16k,
  Hd=2048, V=151936 on an H200 for ~45 ms of GEMMs).
- ``"triton"`` (``_flce_triton``): chunked cuBLAS matmuls in the compute dtype plus one Triton
  kernel per chunk that writes the row losses and ``softmax - onehot`` in place into the
  logits buffer; no host synchronisation at all, weight gradient accumulated in fp32, chunks
  sized for a 1 GiB compute-dtype logits buffer (~3.5k tokens at V=151936). CUDA, or CPU under
  ``TRITON_INTERPRET=1`` (tests). The default on CUDA: 50.4 ms fwd+bwd at the shapes above on
  an H200 against Liger's 65.5 ms in the same run (``benchmarks/kernels/bench_flce.py``,
  2026-12-03), for +2.4 GB of peak memory (the 1 GiB logits buffer and the fp32 weight gradient).
- ``"torch"``: chunks of tokens in plain torch, any device, sync-free but slow (~162 ms at the
  shapes above: ~10 fp32 passes over each chunk's logits). Each chunk materialises ``[chunk, V]``
  fp32 logits only, sized by ``memory_budget_bytes`` (512 MiB by default).

Trade-off (the torch and triton paths follow Liger): gradients w.r.t. hidden, weight and bias are
computed *during the forward*, chunk by chunk, and kept until backward (``[T, Hd]`` plus
``[V, Hd]`` fp32 for the weight). The alternative, recomputing the logits in backward, would
save that memory between forward and backward but costs a second ``T x V x Hd`` matmul (~+50%
of this op's FLOPs). When no input requires grad, no gradient is computed. The weight gradient
is accumulated in fp32 over chunks (each chunk's matmul runs in the compute dtype).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["fused_linear_cross_entropy", "labelled_rows"]

_DEFAULT_BUDGET = 512 * 2**20  # torch backend: bytes for one chunk's fp32 logits + probabilities


@functools.cache
def _liger_fn():
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:
        return None
    return LigerFusedLinearCrossEntropyFunction


def _compute_dtype(x: torch.Tensor, default: torch.dtype | None = None) -> torch.dtype:
    """The autocast dtype of ``x``'s device when autocast is on there, else ``default`` (or
    ``x.dtype``)."""
    dev = x.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except (TypeError, RuntimeError):
        pass
    return x.dtype if default is None else default


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, chunk: int, tw, stats):
        # hidden [T, Hd], weight [V, Hd], bias [V] | None, labels [T], tw [T] fp32 | None,
        # stats: None or (token losses [T] fp32, token hits [T] bool) filled here
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(cdt), weight.to(cdt)
            b = bias.to(cdt) if bias is not None else None
            t = hidden.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            g_h = torch.empty_like(hidden) if need_h else None
            g_w = (
                torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                if need_w
                else None
            )
            g_b = (
                torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                if need_b
                else None
            )
            for s in range(0, t, chunk):
                h, y = h_all[s : s + chunk], labels[s : s + chunk]
                logits = h @ w.T  # [c, V] in cdt
                if b is not None:
                    logits = logits + b
                logits = logits.float()
                valid = y != ignore_index  # [c]
                y_safe = torch.where(valid, y, torch.zeros_like(y))
                lse = torch.logsumexp(logits, dim=-1)  # [c]
                target = logits.gather(1, y_safe[:, None]).squeeze(1)
                rows = (lse - target) * valid  # [c]
                keep = valid.float() if tw is None else valid * tw[s : s + chunk]  # [c]
                loss += (rows if tw is None else rows * keep).sum()
                if stats is not None:
                    stats[0][s : s + chunk] = rows
                    stats[1][s : s + chunk] = valid & (target >= logits.amax(-1))
                if not (need_h or need_w or need_b):
                    continue
                # d loss / d logits = softmax - onehot, zero on ignored rows
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(grad.shape[0], device=grad.device), y_safe] -= 1.0
                grad *= keep[:, None]
                if need_b:
                    g_b += grad.sum(0)
                grad = grad.to(cdt)
                if need_h:
                    g_h[s : s + chunk] = (grad @ w).to(hidden.dtype)
                if need_w:
                    g_w += (grad.T @ h).float()
        ctx.save_for_backward(g_h, g_w, g_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        return (*scaled_saved_grads(ctx, grad_out), None, None, None, None, None)


def scaled_saved_grads(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Backward of the backends that compute the gradients in forward: the saved (hidden,
    weight, bias) gradients times ``grad_out``, a device tensor (no host read), in the inputs'
    dtypes (``ctx.dtypes``)."""
    return tuple(
        None if g is None else (g * grad_out).to(dt)
        for g, dt in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
    )


def _chunk_size(t: int, v: int, budget: int) -> int:
    per_token = v * 4 * 2  # fp32 logits + one fp32 temporary
    return max(1, min(t, budget // per_token))


def _triton_usable(device: torch.device) -> bool:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.util.find_spec("triton") is not None and (
        device.type == "cuda" or (interpret and device.type == "cpu")
    )


def _resolve(backend: str, device: torch.device, extras: bool = False) -> str:
    """The backend that runs; ``extras`` (token weights or stats asked for) rules Liger out."""
    if backend not in ("auto", "liger", "torch", "triton"):
        raise ValueError(
            f"unknown fused linear CE backend {backend!r}; "
            "choose 'auto', 'liger', 'triton' or 'torch'"
        )
    if backend == "triton" and not _triton_usable(device):
        raise RuntimeError(
            f"backend 'triton' needs triton and CUDA tensors (or CPU with TRITON_INTERPRET=1), "
            f"got tensors on {device}"
        )
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if _triton_usable(device):
            return "triton"
        return "liger" if _liger_fn() is not None and not extras else "torch"
    if backend == "liger":
        if _liger_fn() is None:
            raise RuntimeError(
                "backend 'liger' needs liger-kernel: pip install 'lmms-kernels[liger]'"
            )
        if device.type != "cuda":
            raise RuntimeError(f"backend 'liger' runs on CUDA only, got tensors on {device}")
        if extras:
            raise NotImplementedError(
                "backend 'liger' has no token_weights / token_stats; use 'triton' or 'torch'"
            )
    return backend


def labelled_rows(labels, ignore_index: int = -100) -> torch.Tensor:
    """The indices ``[T_l]`` (int64) of the rows of ``labels [T]`` that carry a label, for
    :func:`fused_linear_cross_entropy`'s ``rows``. Call it on the *host* copy of the labels (a
    numpy array or CPU tensor, as the data loader hands them over) and move the result with the
    batch: on a device tensor it would read the count back (``nonzero`` synchronises)."""
    t = torch.as_tensor(labels).reshape(-1)
    return torch.nonzero(t != ignore_index).reshape(-1).to(torch.int64)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,  # [T, Hd]
    weight: torch.Tensor,  # [V, Hd]
    labels: torch.Tensor,  # [T] int64
    *,
    bias: torch.Tensor | None = None,  # [V]
    ignore_index: int = -100,
    backend: str = "auto",
    memory_budget_bytes: int | None = None,
    token_weights: torch.Tensor | None = None,  # [T] fp32
    token_stats: bool = False,
    rows: torch.Tensor | None = None,  # [T_l] int64
) -> tuple[torch.Tensor, ...]:
    """Return ``(sum of token losses [fp32 scalar], number of counted tokens [int64 scalar])``.

    Equals ``F.cross_entropy(hidden @ weight.T + bias, labels, reduction="sum",
    ignore_index=ignore_index)`` in value and gradients (up to the compute dtype's rounding),
    never materialising more than one chunk of logits. Under autocast the matmuls run in the
    autocast dtype. ``backend``: "auto" (on CUDA "triton", or Liger where triton is missing;
    elsewhere "torch"), "liger", "triton", "torch".
    ``memory_budget_bytes`` bounds one chunk's logits: by default 512 MiB of fp32 logits and
    their temporary for "torch", 1 GiB of compute-dtype logits for "triton" (Liger ignores it).
    Divide by the *global* token count yourself.

    ``token_weights [T]`` (fp32, optional) weights each token's loss and gradients:
    ``sum_i w_i · CE_i`` (masked diffusion's 1/t weights). The "torch" and "triton" backends fold
    the weight into the ``[c, V]`` logits gradient they already write (no extra pass); Liger has no
    per-token weights ("auto" then takes "triton", or "torch" without triton).
    ``token_stats=True`` also returns, without gradients, ``token_loss [T]`` (fp32, unweighted, 0
    on ignored rows) and ``token_hit [T]`` (bool: the label's logit is the row's maximum, i.e. an
    argmax prediction is right; False on ignored rows), read from the logits the loss computes
    anyway: masked-token accuracy at no extra matmul.

    ``rows [T_l]`` (int64 indices into ``[0, T)``, optional; :func:`labelled_rows`) restricts the
    LM head and the loss to those rows: ``hidden[rows]`` is gathered (``index_select``, whose
    backward scatters the gradient back into ``[T, Hd]``) and only ``T_l`` rows of logits are ever
    computed. Every row outside ``rows`` must be ignored (label ``ignore_index``, or weight 0):
    such a row adds nothing to the loss and gets a zero gradient on the full path too, so the loss
    and every gradient are the full path's up to the order of fp32 sums (the chunks fall
    differently). Packs whose prompt, image and padding rows are unlabelled (about half of a VL
    pack) save that share of the head's ``2·T·Hd·V`` forward and ``4·T·Hd·V`` backward FLOPs.
    Rows given on the host (``rows.numel()``: a shape, not a read) keep the call sync-free; an
    empty ``rows`` returns a zero loss with zero gradients (on the "torch" backend for Liger).
    ``token_weights`` and ``labels`` stay ``[T]``; ``token_stats`` come back as ``[T]`` (zeros
    outside ``rows``).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, Hd], weight [V, Hd]; got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be [T] with T={hidden.shape[0]}")
    count = (labels != ignore_index).sum()
    if rows is not None:
        return _on_rows(
            hidden, weight, labels, rows, bias=bias, ignore_index=ignore_index, backend=backend,
            memory_budget_bytes=memory_budget_bytes, token_weights=token_weights,
            token_stats=token_stats, count=count,
        )  # fmt: skip
    if token_weights is not None and token_weights.shape != labels.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must be [T] like labels")
    tw = None if token_weights is None else token_weights.detach().float().contiguous()
    name = _resolve(backend, hidden.device, extras=token_weights is not None or token_stats)
    stats = None
    if token_stats:
        t = hidden.shape[0]
        stats = (
            torch.zeros(t, dtype=torch.float32, device=hidden.device),
            torch.zeros(t, dtype=torch.bool, device=hidden.device),
        )
    loss = _backend_loss(
        name, hidden, weight, bias, labels, ignore_index, memory_budget_bytes, tw, stats
    )
    return (loss, count) if stats is None else (loss, count, *stats)


def _backend_loss(name, hidden, weight, bias, labels, ignore_index, memory_budget_bytes, tw, stats):
    """The fp32 summed loss of backend ``name`` (resolved; "liger" only without ``tw``/``stats``).
    ``tw [T]`` fp32 | None; ``stats``: None or (token losses [T], token hits [T]) filled here."""
    if name == "liger":
        fn = _liger_fn()
        out = fn.apply(
            hidden.contiguous(),
            weight,
            labels.contiguous(),
            bias,
            None,
            ignore_index,
            0.0,
            0.0,
            "sum",
        )
        loss = out[0] if isinstance(out, tuple) else out
        return loss.float()
    if name == "triton":
        from . import _flce_triton

        budget = _flce_triton.DEFAULT_BUDGET if memory_budget_bytes is None else memory_budget_bytes
        cdt = _compute_dtype(hidden)
        return _flce_triton.linear_cross_entropy(
            hidden, weight, bias, labels, ignore_index, cdt, budget, token_weights=tw, stats=stats
        )
    budget = _DEFAULT_BUDGET if memory_budget_bytes is None else memory_budget_bytes
    chunk = _chunk_size(hidden.shape[0], weight.shape[0], budget)
    return _ChunkedLinearCE.apply(hidden, weight, bias, labels, ignore_index, chunk, tw, stats)


def _on_rows(
    hidden: torch.Tensor,  # [T, Hd]
    weight: torch.Tensor,  # [V, Hd]
    labels: torch.Tensor,  # [T]
    rows: torch.Tensor,  # [T_l] int64
    *,
    bias: torch.Tensor | None,
    ignore_index: int,
    backend: str,
    memory_budget_bytes: int | None,
    token_weights: torch.Tensor | None,
    token_stats: bool,
    count: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """:func:`fused_linear_cross_entropy` on ``hidden[rows]`` (see its ``rows``)."""
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"rows must be a 1-D integer index tensor, got {rows.dtype} {tuple(rows.shape)}"
        )
    if token_weights is not None and token_weights.shape != labels.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must be [T] like labels")
    rows = rows.to(hidden.device, torch.int64, non_blocking=True)
    h = hidden.index_select(0, rows)  # [T_l, Hd]
    y = labels.index_select(0, rows)  # [T_l]
    tw = None if token_weights is None else token_weights.index_select(0, rows)
    name = backend
    if rows.numel() == 0 and _resolve(backend, hidden.device) == "liger":
        name = "torch"  # Liger's kernel has no empty launch; zero loss, zero gradients
    out = fused_linear_cross_entropy(
        h, weight, y, bias=bias, ignore_index=ignore_index, backend=name,
        memory_budget_bytes=memory_budget_bytes, token_weights=tw, token_stats=token_stats,
    )  # fmt: skip
    if not token_stats:
        return out[0], count
    t = hidden.shape[0]
    loss_rows = torch.zeros(t, dtype=torch.float32, device=hidden.device).index_copy_(
        0, rows, out[2]
    )
    hit = torch.zeros(t, dtype=torch.bool, device=hidden.device).index_copy_(0, rows, out[3])
    return out[0], count, loss_rows, hit
