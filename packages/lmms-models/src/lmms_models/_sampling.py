"""Helpers of the generative families' ``render`` (:class:`lmms_models.Renders`): seeded ODE
sampling of a latent denoiser and the conversion of decoded media to uint8 RGB."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["sample_latents", "to_uint8"]


def sample_latents(
    spec: Any, model: Any, cfg: Any, cond: Any, shape: tuple[int, ...], *, steps: int,
    method: str, guidance: float, seed: int,
) -> torch.Tensor:  # fmt: skip
    """Latents ``[B, *shape]`` for conditions ``cond`` (batch of B) from seeded noise: the
    probability-flow ODE of the run's flow-matching options ``cfg``, classifier-free guidance
    against the spec's null condition."""
    from ._flow_matching import ode_sample

    device = next(model.parameters()).device
    b = cond.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn((b, *shape), generator=gen).to(device)
    null = spec.null_condition(model, b, device)

    def net(x: torch.Tensor, t: torch.Tensor, uncond: bool) -> torch.Tensor:
        return spec.denoise(model, x, t, null if uncond else cond)

    return ode_sample(cfg, net, noise, steps=steps, method=method, guidance=guidance)


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """Media in [-1, 1] as uint8 (same layout)."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().byte().cpu().numpy()
