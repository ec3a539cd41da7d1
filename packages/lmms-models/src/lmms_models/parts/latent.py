"""Latent-image pieces the generative families share (``sit``, ``bagel``): the fixed 2-D sin-cos
position table and the VAE encoding of pixels to scaled latents."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["encode_latents", "sincos_2d"]


def sincos_2d(dim: int, gh: int, gw: int, device: Any = None) -> torch.Tensor:
    """Fixed 2-D sin-cos position table ``[gh * gw, dim]`` (row-major patches): the first half of
    the channels encodes the column, the second half the row (DiT/MAE layout)."""

    def one_d(d: int, pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64, device=device) / (d / 2))
        out = pos.double()[:, None] * omega[None]  # [N, d/2]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    rows = torch.arange(gh, device=device).repeat_interleave(gw)
    cols = torch.arange(gw, device=device).repeat(gh)
    return torch.cat([one_d(dim // 2, cols), one_d(dim // 2, rows)], dim=1).float()


def encode_latents(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Latents of ``pixels [B, 3, H, W]`` in [-1, 1] through a diffusers ``AutoencoderKL``: the
    posterior mean (deterministic: a resumed run sees the same latents) times the VAE's
    ``scaling_factor`` (SD VAE: 0.18215), shifted by ``shift_factor`` when it has one."""
    with torch.no_grad():
        posterior = vae.encode(pixels.to(next(vae.parameters()).dtype)).latent_dist
        z = posterior.mean.float()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (z - shift) * vae.config.scaling_factor
