"""Plug ``varlen_attention`` into transformers' attention-function registry.

Upstream model code calls ``fn(module, query, key, value, attention_mask, scaling=, dropout=,
**kwargs)`` with ``query [B, H, L, D]`` and expects ``(out [B, L, H, D], None)``. The function
registered here:

- reads the packed boundaries from ``cu_seq_lens_q/k`` and ``max_length_q/k`` (transformers'
  names); ``B`` rows are flattened, so packed callers pass ``B == 1``;
- without them and without ``attention_mask``, treats every batch row as one segment;
- with a 2-D padding mask ``[B, L]`` (1 = keep) and no ``cu_seq_lens``, unpads: each row's kept
  tokens become one segment and padded positions return zeros. The registered name is also
  registered in transformers' mask registry so that models hand it that 2-D mask;
- raises on 4-D masks, sliding windows and attention dropout, which it does not implement;
- takes causality from the ``is_causal`` kwarg, else ``module.is_causal`` (vision towers set it
  False), else True;
- casts q/k/v to one dtype (the autocast dtype when autocast is on, else v's dtype): the
  Qwen-VL vision rotary returns fp32 q/k under autocast.

Names containing "flash" make Qwen2.5-VL's vision tower pass ``cu_seq_lens_q/k`` (one call for
all images instead of a Python loop over windows). Such names must be set on the configs after
the model is built (``config._attn_implementation = name`` on the top, text and vision
configs): at construction transformers >= 5.2x looks "flash" names up as hub kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ._attention import resolve_backend, varlen_attention
from ._flce import _compute_dtype

__all__ = ["register_varlen_attention"]


def _segments_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[B, L] keep-mask -> (flat indices of kept tokens, cu_seqlens [B+1] int32, max length)."""
    keep = mask.bool()
    idx = keep.flatten().nonzero().squeeze(1)
    lens = keep.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return idx, cu, int(lens.max()) if lens.numel() else 0


def _refuse_unsupported(dropout: float, kwargs: dict) -> None:
    if dropout:
        raise NotImplementedError(f"lmms varlen attention has no attention dropout (got {dropout})")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"lmms varlen attention does not implement sliding windows (got {kwargs['sliding_window']}); "
            "disable use_sliding_window in the model config"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("lmms varlen attention does not implement logit soft-capping")


def _boundaries(
    kwargs: dict,
    attention_mask: torch.Tensor | None,
    b: int,
    lq: int,
    lk: int,
    device: torch.device,
):
    """``(idx, cu_q, cu_k, max_q, max_k)`` of a call: the packed boundaries it was given, one
    segment per batch row, or (``idx``: flat indices of the kept tokens, else None) the rows of
    a 2-D ``[B, L]`` padding mask unpadded."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k", cu_q)
        max_q = kwargs.get("max_length_q")
        max_k = kwargs.get("max_length_k", max_q)
        # left as 0-d tensors: varlen_attention reads them outside compiled graphs
        if max_q is None:
            max_q = (cu_q[1:] - cu_q[:-1]).max()
        if max_k is None:
            max_k = (cu_k[1:] - cu_k[:-1]).max()
        return None, cu_q, cu_k, max_q, max_k
    if attention_mask is None:
        cu_q = torch.arange(b + 1, device=device, dtype=torch.int32) * lq
        cu_k = torch.arange(b + 1, device=device, dtype=torch.int32) * lk
        return None, cu_q, cu_k, lq, lk
    if attention_mask.dim() == 2 and attention_mask.shape == (b, lq) and lq == lk:
        idx, cu, mx = _segments_from_mask(attention_mask)
        return idx, cu, cu, mx, mx
    raise ValueError(
        f"lmms varlen attention got an attention_mask of shape {tuple(attention_mask.shape)}; it "
        "handles only 2-D [B, L] padding masks (or none). Pass packed rows with cu_seq_lens_q/k "
        "instead of 4-D masks."
    )


def _make_attention_fn(backend: str, wrapper: Callable | None) -> Callable:
    inner = functools.partial(varlen_attention, backend=backend)

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,  # [B, H, L, D]
        key: torch.Tensor,  # [B, KV, L, D]
        value: torch.Tensor,  # [B, KV, L, D]
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:  # ([B, L, H, D], None)
        _refuse_unsupported(dropout, kwargs)
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        b, h, lq, _ = query.shape
        idx, cu_q, cu_k, max_q, max_k = _boundaries(
            kwargs, attention_mask, b, lq, key.shape[2], query.device
        )
        dt = _compute_dtype(value)  # one dtype for q/k/v: autocast's, else v's
        # [B, H, L, D] -> [B*L, H, D]
        q, k, v = (
            x.transpose(1, 2).reshape(b * x.shape[2], x.shape[1], x.shape[3]).to(dt)
            for x in (query, key, value)
        )
        if idx is not None:  # unpadded: the kept tokens only
            q, k, v = q[idx], k[idx], v[idx]
        attend = wrapper if wrapper is not None else inner
        extra = {"inner": inner} if wrapper is not None else {}
        out = attend(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scaling, **extra
        )
        if idx is not None:  # padded positions return zeros
            out = out.new_zeros(b * lq, h, out.shape[-1]).index_copy(0, idx, out)
        return out.reshape(b, lq, h, out.shape[-1]), None

    return attention


def register_varlen_attention(
    name: str = "lmms_varlen", *, backend: str = "auto", wrapper: Callable | None = None
) -> str:
    """Register a varlen attention function with transformers under ``name``; return ``name``.

    ``backend`` is resolved per call by device (``"auto"``) or checked now when explicit (an
    unavailable explicit backend raises here, naming what to install). ``wrapper`` (optional)
    has ``varlen_attention``'s signature plus ``inner=``: lmms-parallel's Ulysses SP plugs in
    here. Several names may coexist (e.g. one for the text decoder, one "flash" name for a
    vision tower). Registering an existing name again replaces it.
    """
    from transformers import AttentionInterface

    if backend != "auto":
        resolve_backend(backend, "cuda" if backend in ("fa4", "fa", "torch") else "cpu")
    elif torch.cuda.is_available():  # recorded for compiled code (`_attention._AUTO`)
        resolve_backend(backend, "cuda")
    AttentionInterface.register(name, _make_attention_fn(backend, wrapper))
    _register_mask(name)
    return name


@functools.cache
def _flash_mask_fn() -> Callable | None:
    try:
        from transformers.masking_utils import flash_attention_mask
    except ImportError:
        return None
    return flash_attention_mask


def _register_mask(name: str) -> None:
    """Make models build a 2-D padding mask (or None) for ``name`` instead of no mask at all."""
    fn = _flash_mask_fn()
    if fn is None:
        return
    try:
        from transformers import AttentionMaskInterface
    except ImportError:
        from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register(name, fn)
