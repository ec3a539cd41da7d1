"""Packing interleaved BAGEL samples into one row.

A *sample* is a list of parts, in order (the interleaved record after its processor):

| part | keys | becomes |
| --- | --- | --- |
| ``{"type": "text"}`` | ``ids`` (list[int]), ``loss`` (bool) | causal text tokens |
| ``{"type": "vit"}`` | ``pixels [3, H, W]`` (H, W multiples of the ViT patch) | a ``full`` span |
| ``{"type": "vae_gen"}`` | ``latents [C, h, w]`` (multiples of the latent patch) or ``pixels`` | a ``noise`` span, FM target |
| ``{"type": "vae_cond"}`` | ``latents [C, h, w]`` or ``pixels [3, H, W]`` | a clean ``full`` span (editing input) |

Every image span is ``<start_of_image> tokens <end_of_image>``; the two markers are text tokens
(understanding weights). All tokens of an image span share one RoPE position; text positions
count up from 0 in each sample. The label of position ``i`` is token ``i + 1`` when that token is
text of a ``loss`` part of the same sample (``-100`` otherwise: markers, images, sample ends).

The generation noise of VAE image ``j`` of a sample comes from ``noise_seed = seed * 64 + j``
(``seed``: the sample's own; through lmms-train a hash of its record reference), so a sample
draws the same noise packed or alone, on any rank, before and after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._mask import CAUSAL, FULL, NOISE, PackLayout
from ._model import BagelConfig

__all__ = ["pack_samples", "patchify", "unpatchify"]

TEXT, VIT, VAE = 0, 1, 2


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``[C, H, W] -> [(H/p) * (W/p), p * p * C]``, patches row-major, each ``(p, q, c)``."""
    c, h, w = x.shape
    if h % p or w % p:
        raise ValueError(f"bagel: image {h}x{w} is not a multiple of patch {p}")
    x = x.reshape(c, h // p, p, w // p, p)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, p * p * c)


def unpatchify(tokens: torch.Tensor, c: int, gh: int, gw: int, p: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: ``[gh * gw, p * p * c] -> [c, gh * p, gw * p]``."""
    x = tokens.reshape(gh, gw, p, p, c)
    return torch.einsum("hwpqc->chpwq", x).reshape(c, gh * p, gw * p)


def pixel_space_latents(factor: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The tiny stand-in for a VAE: ``[3, H, W] -> [3, H/f, W/f]`` by average pooling (a model
    with ``latent_channels: 3``); renders decode by nearest upsampling. Real runs use the frozen
    FLUX VAE (16 channels, factor 8)."""

    def enc(px: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(px[None], factor)[0]

    return enc


def _grid_pos(gh: int, gw: int, side: int) -> torch.Tensor:
    """Flattened 2-D positions in a ``side x side`` table (row * side + col), no interpolation."""
    if gh > side or gw > side:
        raise ValueError(f"bagel: a {gh}x{gw} patch grid exceeds the {side}x{side} position table")
    return (torch.arange(gh)[:, None] * side + torch.arange(gw)[None]).reshape(-1)


def pack_samples(
    samples: Sequence[Sequence[dict[str, Any]]],
    cfg: BagelConfig,
    *,
    start_of_image: int,
    end_of_image: int,
    seeds: Sequence[int] | None = None,
    backend: str = "sdpa",
    varlen_backend: str = "auto",
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One packed row (host tensors) from ``samples``; see the module docstring for parts.

    A VAE part may carry ``pixels [3, H, W]`` in [-1, 1] (lmms_data's bagel processor) instead of
    ``latents``: ``encode`` maps them to latents here (the frozen VAE, or
    :func:`pixel_space_latents` for tiny runs); without ``encode`` the row keeps the pixels
    (``vae_pixels``, ``vae_latents`` entries None, shapes from ``cfg.vae_downsample``) and
    ``BagelSpec.prepare_row`` encodes them on the model's device (the trainer's path)."""
    seeds = list(range(len(samples))) if seeds is None else list(seeds)
    ids: list[int] = []
    sup: list[bool] = []  # token is supervised text (a label target)
    ttype: list[int] = []
    pos: list[int] = []
    span: list[int] = []
    mode: list[int] = []
    sample_lens: list[int] = []
    vit_patches, vit_pos, vit_lens, vit_index = [], [], [], []
    vae_latents, vae_pos, vae_index, vae_noised, vae_seed, vae_lens = [], [], [], [], [], []
    vae_pixels: list[torch.Tensor | None] = []
    n_span = 0
    p_vit, p_lat = cfg.vit.patch_size, cfg.latent_patch_size

    for s_idx, sample in enumerate(samples):
        start = len(ids)
        cur = 0
        n_vae = 0
        for part in sample:
            kind = part["type"]
            if kind == "text":
                n = len(part["ids"])
                ids += list(part["ids"])
                sup += [bool(part.get("loss", True))] * n
                ttype += [TEXT] * n
                pos += list(range(cur, cur + n))
                span += [n_span] * n
                mode += [CAUSAL] * n
                cur += n
                n_span += 1
                continue
            if kind == "vit":
                px = torch.as_tensor(part["pixels"])
                gh, gw = px.shape[-2] // p_vit, px.shape[-1] // p_vit
                toks, tt, m = patchify(px.float(), p_vit), VIT, FULL
                vit_patches.append(toks)
                vit_pos.append(_grid_pos(gh, gw, cfg.vit_max_num_patch_per_side))
                vit_lens.append(toks.shape[0])
                vit_index.append(torch.arange(toks.shape[0]) + len(ids) + 1)
            elif kind in ("vae_gen", "vae_cond"):
                px = None
                if "latents" in part:
                    lat = torch.as_tensor(part["latents"]).float()
                elif encode is not None:
                    lat = encode(torch.as_tensor(part["pixels"]).float()).float()
                else:  # encoded later, on the device (BagelSpec.prepare_row)
                    px = torch.as_tensor(part["pixels"]).float()
                    f = cfg.vae_downsample
                    if px.shape[-2] % f or px.shape[-1] % f:
                        raise ValueError(
                            f"bagel: a {px.shape[-2]}x{px.shape[-1]} image is not a multiple of "
                            f"the VAE factor {f}"
                        )
                    lat = torch.empty(cfg.latent_channels, px.shape[-2] // f, px.shape[-1] // f)
                if lat.shape[0] != cfg.latent_channels:
                    raise ValueError(
                        f"bagel: latents have {lat.shape[0]} channels, the model {cfg.latent_channels}"
                    )
                gh, gw = lat.shape[-2] // p_lat, lat.shape[-1] // p_lat
                n_tok, tt = gh * gw, VAE
                m = NOISE if kind == "vae_gen" else FULL
                patchify(lat, p_lat)  # shape check
                vae_pixels.append(px)
                vae_latents.append(lat if px is None else None)
                vae_pos.append(_grid_pos(gh, gw, cfg.max_latent_size))
                vae_index.append(torch.arange(n_tok) + len(ids) + 1)
                vae_noised.append(kind == "vae_gen")
                vae_seed.append(int(seeds[s_idx]) * 64 + n_vae)
                vae_lens.append(n_tok)
                n_vae += 1
                toks = torch.empty(n_tok, 0)
            else:
                raise ValueError(
                    f"bagel: unknown part type {kind!r} (text, vit, vae_gen, vae_cond)"
                )
            n = toks.shape[0] + 2
            ids += [start_of_image] + [0] * toks.shape[0] + [end_of_image]
            sup += [False] * n
            ttype += [TEXT] + [tt] * toks.shape[0] + [TEXT]
            pos += [cur] * n
            span += [n_span] * n
            mode += [m] * n
            cur += 1
            n_span += 1
        sample_lens.append(len(ids) - start)

    total = len(ids)
    labels = torch.full((total,), -100, dtype=torch.int64)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    sup_t = torch.tensor(sup, dtype=torch.bool)
    ends = torch.tensor(sample_lens).cumsum(0)
    nxt_ok = sup_t[1:].clone()  # target token i+1 must be supervised text ...
    nxt_ok[(ends[:-1] - 1).tolist() if len(ends) > 1 else []] = False  # ... of the same sample
    labels[:-1] = torch.where(nxt_ok, ids_t[1:], labels[:-1])
    ttype_t = torch.tensor(ttype, dtype=torch.int8)
    mode_t = torch.tensor(mode, dtype=torch.int8)
    noised_tok = torch.zeros(total, dtype=torch.bool)
    for idx, noised in zip(vae_index, vae_noised, strict=True):
        noised_tok[idx] = noised
    cu = torch.zeros(len(sample_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(sample_lens).cumsum(0)
    cat = lambda xs, dt=torch.int64: torch.cat(xs).to(dt) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    layout = PackLayout(
        cu_seqlens=cu, sample_lens=sample_lens, span_id=torch.tensor(span, dtype=torch.int32),
        mode=mode_t, all_causal=bool((mode_t == CAUSAL).all()), backend=backend,
        varlen_backend=varlen_backend,
    )  # fmt: skip
    ce_index = (labels != -100).nonzero().squeeze(1)
    fm_index = noised_tok.nonzero().squeeze(1)
    return {
        "input_ids": ids_t,
        "labels": labels,
        "position_ids": torch.tensor(pos, dtype=torch.int64),
        "token_type": ttype_t,
        "layout": layout,
        "cu_seqlens": cu,
        "vit_patches": cat(vit_patches, torch.float32).reshape(-1, 3 * p_vit * p_vit),
        "vit_pos": cat(vit_pos),
        "vit_cu": torch.tensor([0, *torch.tensor(vit_lens).cumsum(0).tolist()], dtype=torch.int32),
        "vit_index": cat(vit_index),
        "vae_latents": vae_latents,
        **({"vae_pixels": vae_pixels} if any(x is not None for x in vae_pixels) else {}),
        "vae_pos": cat(vae_pos),
        "vae_index": cat(vae_index),
        "vae_noised": vae_noised,
        "vae_lens": vae_lens,
        "noise_seed": torch.tensor(vae_seed, dtype=torch.int64),
        "ce_index": ce_index,
        "fm_index": fm_index,
        "num_loss_tokens": int(ce_index.numel() + fm_index.numel()),
        "num_ce_tokens": int(ce_index.numel()),
        "num_fm_tokens": int(fm_index.numel()),
        "num_samples": len(samples),
    }


def batch_to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """The row on ``device`` (tensors, the layout and the latent list moved; host ints kept)."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, (torch.Tensor, PackLayout)):
            out[k] = v.to(device)
        elif k in ("vae_latents", "vae_pixels"):
            out[k] = [None if x is None else x.to(device) for x in v]
        else:
            out[k] = v
    return out
