"""SiT's ``render``: a grid of class-conditioned samples, one row per class."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..._capabilities import RenderRequest
from ..._diffusion import get_encoder
from ..._sampling import sample_latents, to_uint8


def render_grid(spec: Any, model: Any, request: RenderRequest) -> np.ndarray:
    """uint8 ``[rows * H, per_class * W, 3]``: ``request.per_class`` samples of each class
    (``request.classes``; None: every class), decoded through the VAE when the model has one."""
    conf = model.config
    device = next(model.parameters()).device
    classes = list(range(conf.num_classes)) if request.classes is None else list(request.classes)
    per_class = request.per_class
    y = torch.tensor(classes, device=device).repeat_interleave(per_class)
    vae = get_encoder(model, "vae", device)
    side = conf.input_size
    x = sample_latents(
        spec, model, request.flow_matching, y, (conf.in_channels, side, side),
        steps=request.steps, method=request.method, guidance=request.guidance, seed=request.seed,
    )  # fmt: skip
    if vae is not None:
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        x = vae.decode(x / vae.config.scaling_factor + shift).sample
    imgs = to_uint8(x).transpose(0, 2, 3, 1)  # [N, H, W, 3]
    h, w = imgs.shape[1:3]
    grid = np.zeros((len(classes) * h, per_class * w, 3), np.uint8)
    for i, img in enumerate(imgs):
        r, c = divmod(i, per_class)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = img
    return grid
