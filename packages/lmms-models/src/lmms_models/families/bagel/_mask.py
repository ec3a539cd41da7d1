"""Per-span attention of a packed BAGEL row: causal for text, full inside an image, never across
samples.

A packed row is a sequence of *samples* (``cu_seqlens``), each a sequence of *spans*. A span has a
mode:

* ``causal`` (text): a token sees every earlier token of its sample;
* ``full`` (a ViT image, or the clean VAE latents of an editing input): also every token of its
  own span, so the image is bidirectional inside;
* ``noise`` (noised VAE latents that are being generated): like ``full``, and no token *outside*
  the span may see it (later text must not read a noised image; it reads the clean one or none).

``mask(q, k) = same sample and (k <= q or same non-causal span) and not (k in another noise span)``
(the rule of the reference implementation's ``create_sparse_mask``).

Backends (``PackLayout.backend``):

* ``"sdpa"``: one dense ``[L, L]`` boolean mask per sample and ``scaled_dot_product_attention``
  per sample. Any device; the reference.
* ``"flex"``: FlexAttention over the whole row with a block mask from the same rule (built once
  per row, shared by every layer). Compiled on CUDA (block-sparse: the cost follows the mask);
  eager elsewhere (tests).
* ``"auto"``: ``flex`` on CUDA, ``sdpa`` elsewhere (FlexAttention has no CPU backward).
* A row whose spans are all ``causal`` (text only) goes through lmms_kernels' varlen attention
  (``varlen_backend``: flash-attn on GPUs), whichever backend is chosen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CAUSAL", "FULL", "MODES", "NOISE", "PackLayout", "dense_mask", "span_attention"]

CAUSAL, FULL, NOISE = 0, 1, 2
MODES = {"causal": CAUSAL, "full": FULL, "noise": NOISE}


def dense_mask(span_id: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
    """Boolean ``[L, L]`` mask of one sample from per-token ``span_id [L]`` and ``mode [L]``."""
    pos = torch.arange(span_id.shape[0], device=span_id.device)
    same = span_id[:, None] == span_id[None, :]
    allowed = (pos[None, :] <= pos[:, None]) | (same & (mode[:, None] != CAUSAL))
    return allowed & ~((mode[None, :] == NOISE) & ~same)


@dataclass(kw_only=True)
class PackLayout:
    """The attention structure of one packed row (device tensors plus host lengths)."""

    cu_seqlens: torch.Tensor  # [n+1] int32 sample boundaries
    sample_lens: list[int]  # host copy of the sample lengths
    span_id: torch.Tensor  # [T] int32, unique per span in the row
    mode: torch.Tensor  # [T] int8 per token: CAUSAL / FULL / NOISE of its span
    all_causal: bool  # text only: the varlen fast path
    backend: str = "sdpa"  # "sdpa" | "flex" | "auto"
    varlen_backend: str = "auto"
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def to(self, device: Any) -> PackLayout:
        return PackLayout(
            cu_seqlens=self.cu_seqlens.to(device),
            sample_lens=self.sample_lens,
            span_id=self.span_id.to(device),
            mode=self.mode.to(device),
            all_causal=self.all_causal,
            backend=self.backend,
            varlen_backend=self.varlen_backend,
        )

    def sample_masks(self) -> list[torch.Tensor]:
        """Dense masks of the samples (cached for the row)."""
        if "dense" not in self._cache:
            out, start = [], 0
            for n in self.sample_lens:
                out.append(
                    dense_mask(self.span_id[start : start + n], self.mode[start : start + n])
                )
                start += n
            self._cache["dense"] = out
        return self._cache["dense"]

    def block_mask(self, heads: int) -> Any:
        """FlexAttention block mask of the whole row (cached for the row)."""
        if "block" not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            total = int(sum(self.sample_lens))
            dev = self.span_id.device
            doc = torch.repeat_interleave(
                torch.arange(len(self.sample_lens), device=dev),
                torch.tensor(self.sample_lens, device=dev),
            )
            sid, mode = self.span_id, self.mode

            def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
                same = sid[q] == sid[k]
                seen = (k <= q) | (same & (mode[q] != CAUSAL))
                return (doc[q] == doc[k]) & seen & ~((mode[k] == NOISE) & ~same)

            # compiled on CUDA as torch advises (its `_compile=True` flag is deprecated: 2.11)
            make = _compiled_block_mask() if dev.type == "cuda" else create_block_mask
            self._cache["block"] = make(mask_mod, None, None, total, total, device=dev)
        return self._cache["block"]


@functools.cache
def _compiled_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@functools.cache
def _flex_fn(compiled: bool) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def span_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    layout: PackLayout,
) -> torch.Tensor:  # [T, H, D]
    """Attention of a packed row under its span rules (see the module docstring)."""
    if layout.all_causal:
        from lmms_kernels import varlen_attention

        cu = layout.cu_seqlens
        mx = max(layout.sample_lens)
        return varlen_attention(q, k, v, cu, cu, mx, mx, causal=True, backend=layout.varlen_backend)
    rep = q.shape[1] // k.shape[1]
    backend = layout.backend
    if backend == "auto":
        backend = "flex" if q.device.type == "cuda" else "sdpa"
    if backend == "flex":
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]
        compiled = q.device.type == "cuda"
        # a row under 128 tokens would go to Inductor's flex-decoding template, which had no
        # kernel for the tiny model's shapes (torch 2.11, H100: NoValidChoicesError); the main
        # kernel takes every row (training rows are packing_length long and took it already)
        opts = {"FORCE_USE_FLEX_ATTENTION": True} if compiled else None
        out = _flex_fn(compiled)(
            qt, kt, vt, block_mask=layout.block_mask(q.shape[1]), enable_gqa=rep > 1,
            kernel_options=opts,
        )  # fmt: skip
        return out[0].transpose(0, 1)
    if backend != "sdpa":
        raise ValueError(f"bagel attention backend {backend!r}: choose sdpa, flex or auto")
    outs, start = [], 0
    for n, mask in zip(layout.sample_lens, layout.sample_masks(), strict=True):
        sl = slice(start, start + n)
        qs = q[sl].transpose(0, 1)  # [H, L, D]
        ks = k[sl].repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[sl].repeat_interleave(rep, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0)
