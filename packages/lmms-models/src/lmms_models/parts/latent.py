"""Latent-image pieces the generative families share (``sit``, ``bagel``): the fixed 2-D sin-cos
position table, the noise-level embedding, the GELU MLP, and the VAE encoding of pixels to scaled
latents."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GeluMlp", "TimestepEmbedder", "encode_latents", "sincos_2d", "timestep_features"]


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


def timestep_features(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[B, dim]`` (cos first) of continuous times ``t [B]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]  # [B, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """``mlp(sinusoid(t))``: ``freq_dim`` cos|sin features of the noise level, then
    Linear-SiLU-Linear (DiT's layout: ``mlp.0``, ``mlp.2``)."""

    def __init__(self, hidden: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        feats = timestep_features(t, self.freq_dim)
        return self.mlp(feats.to(self.mlp[0].weight.dtype))


class GeluMlp(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``: ``d_in -> hidden -> d_out``."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def encode_latents(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Latents of ``pixels [B, 3, H, W]`` in [-1, 1] through a diffusers ``AutoencoderKL``: the
    posterior mean (deterministic: a resumed run sees the same latents) times the VAE's
    ``scaling_factor`` (SD VAE: 0.18215), shifted by ``shift_factor`` when it has one."""
    with torch.no_grad():
        posterior = vae.encode(pixels.to(next(vae.parameters()).dtype)).latent_dist
        z = posterior.mean.float()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (z - shift) * vae.config.scaling_factor
