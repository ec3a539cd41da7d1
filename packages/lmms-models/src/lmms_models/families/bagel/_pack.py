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
from dataclasses import dataclass, field
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
    row = _Row(cfg=cfg, markers=(start_of_image, end_of_image))
    for s_idx, sample in enumerate(samples):
        start, row.cur, n_vae = len(row.ids), 0, 0
        for part in sample:
            kind = part["type"]
            if kind == "text":
                row.add_text(list(part["ids"]), bool(part.get("loss", True)))
            elif kind == "vit":
                row.add_vit(torch.as_tensor(part["pixels"]))
            elif kind in ("vae_gen", "vae_cond"):
                lat, px = _vae_input(part, cfg, encode)
                row.add_vae(lat, px, noised=kind == "vae_gen", seed=int(seeds[s_idx]) * 64 + n_vae)
                n_vae += 1
            else:
                raise ValueError(
                    f"bagel: unknown part type {kind!r} (text, vit, vae_gen, vae_cond)"
                )
        row.sample_lens.append(len(row.ids) - start)
    return row.finish(backend=backend, varlen_backend=varlen_backend)


def _vae_input(
    part: dict[str, Any], cfg: BagelConfig, encode: Callable[[torch.Tensor], torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(latents [C, h, w], pixels or None)`` of a VAE part: its latents, its pixels encoded
    by ``encode``, or (no ``encode``) its pixels kept with empty latents of their shape."""
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
    return lat, px


@dataclass(kw_only=True)
class _Row:
    """A packed row as it grows: per-token lists, per-image entries, the span count, and the
    position ``cur`` within the current sample."""

    cfg: BagelConfig
    markers: tuple[int, int]  # start_of_image, end_of_image
    ids: list[int] = field(default_factory=list)
    sup: list[bool] = field(default_factory=list)  # token is supervised text (a label target)
    ttype: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    span: list[int] = field(default_factory=list)
    mode: list[int] = field(default_factory=list)
    sample_lens: list[int] = field(default_factory=list)
    vit: dict[str, list[Any]] = field(default_factory=lambda: _lists("patches pos lens index"))
    vae: dict[str, list[Any]] = field(
        default_factory=lambda: _lists("latents pixels pos index noised seed lens")
    )
    n_span: int = 0
    cur: int = 0

    def add_text(self, ids: list[int], loss: bool) -> None:
        n = len(ids)
        self.ids += ids
        self.sup += [loss] * n
        self.ttype += [TEXT] * n
        self.pos += list(range(self.cur, self.cur + n))
        self.span += [self.n_span] * n
        self.mode += [CAUSAL] * n
        self.cur += n
        self.n_span += 1

    def add_vit(self, px: torch.Tensor) -> None:
        p = self.cfg.vit.patch_size
        toks = patchify(px.float(), p)
        v = self.vit
        v["patches"].append(toks)
        v["pos"].append(
            _grid_pos(px.shape[-2] // p, px.shape[-1] // p, self.cfg.vit_max_num_patch_per_side)
        )
        v["lens"].append(toks.shape[0])
        v["index"].append(torch.arange(toks.shape[0]) + len(self.ids) + 1)
        self._add_image(toks.shape[0], VIT, FULL)

    def add_vae(
        self, lat: torch.Tensor, px: torch.Tensor | None, *, noised: bool, seed: int
    ) -> None:
        p = self.cfg.latent_patch_size
        gh, gw = lat.shape[-2] // p, lat.shape[-1] // p
        patchify(lat, p)  # shape check
        v = self.vae
        v["pixels"].append(px)
        v["latents"].append(lat if px is None else None)
        v["pos"].append(_grid_pos(gh, gw, self.cfg.max_latent_size))
        v["index"].append(torch.arange(gh * gw) + len(self.ids) + 1)
        v["noised"].append(noised)
        v["seed"].append(seed)
        v["lens"].append(gh * gw)
        self._add_image(gh * gw, VAE, NOISE if noised else FULL)

    def _add_image(self, n_tok: int, tt: int, m: int) -> None:
        """An image span: ``<start_of_image> n_tok tokens <end_of_image>``, one position."""
        n = n_tok + 2
        self.ids += [self.markers[0]] + [0] * n_tok + [self.markers[1]]
        self.sup += [False] * n
        self.ttype += [TEXT] + [tt] * n_tok + [TEXT]
        self.pos += [self.cur] * n
        self.span += [self.n_span] * n
        self.mode += [m] * n
        self.cur += 1
        self.n_span += 1

    def finish(self, *, backend: str, varlen_backend: str) -> dict[str, Any]:
        """The row's tensors (the module docstring's labels, the span layout, the media)."""
        total, vit, vae = len(self.ids), self.vit, self.vae
        labels = torch.full((total,), -100, dtype=torch.int64)
        ids_t = torch.tensor(self.ids, dtype=torch.int64)
        ends = torch.tensor(self.sample_lens).cumsum(0)
        nxt_ok = torch.tensor(self.sup, dtype=torch.bool)[1:].clone()  # target i+1 must be
        nxt_ok[(ends[:-1] - 1).tolist() if len(ends) > 1 else []] = False  # text of the sample
        labels[:-1] = torch.where(nxt_ok, ids_t[1:], labels[:-1])
        mode_t = torch.tensor(self.mode, dtype=torch.int8)
        noised_tok = torch.zeros(total, dtype=torch.bool)
        for idx, noised in zip(vae["index"], vae["noised"], strict=True):
            noised_tok[idx] = noised
        cu = torch.zeros(len(self.sample_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(self.sample_lens).cumsum(0)
        layout = PackLayout(
            cu_seqlens=cu, sample_lens=self.sample_lens,
            span_id=torch.tensor(self.span, dtype=torch.int32), mode=mode_t,
            all_causal=bool((mode_t == CAUSAL).all()), backend=backend,
            varlen_backend=varlen_backend,
        )  # fmt: skip
        ce_index = (labels != -100).nonzero().squeeze(1)
        fm_index = noised_tok.nonzero().squeeze(1)
        p_vit = self.cfg.vit.patch_size
        pixels = vae["pixels"]
        return {
            "input_ids": ids_t,
            "labels": labels,
            "position_ids": torch.tensor(self.pos, dtype=torch.int64),
            "token_type": torch.tensor(self.ttype, dtype=torch.int8),
            "layout": layout,
            "cu_seqlens": cu,
            "vit_patches": _cat(vit["patches"], torch.float32).reshape(-1, 3 * p_vit * p_vit),
            "vit_pos": _cat(vit["pos"]),
            "vit_cu": torch.tensor(
                [0, *torch.tensor(vit["lens"]).cumsum(0).tolist()], dtype=torch.int32
            ),
            "vit_index": _cat(vit["index"]),
            "vae_latents": vae["latents"],
            **({"vae_pixels": pixels} if any(x is not None for x in pixels) else {}),
            "vae_pos": _cat(vae["pos"]),
            "vae_index": _cat(vae["index"]),
            "vae_noised": vae["noised"],
            "vae_lens": vae["lens"],
            "noise_seed": torch.tensor(vae["seed"], dtype=torch.int64),
            "ce_index": ce_index,
            "fm_index": fm_index,
            "num_loss_tokens": int(ce_index.numel() + fm_index.numel()),
            "num_ce_tokens": int(ce_index.numel()),
            "num_fm_tokens": int(fm_index.numel()),
            "num_samples": len(self.sample_lens),
        }


def _lists(names: str) -> dict[str, list[Any]]:
    return {n: [] for n in names.split()}


def _cat(xs: list[torch.Tensor], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.cat(xs).to(dtype) if xs else torch.zeros(0, dtype=dtype)


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
