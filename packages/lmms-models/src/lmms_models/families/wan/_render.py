"""Wan's ``render``: one clip per prompt, side by side."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..._capabilities import RenderRequest
from ..._diffusion import get_encoder
from ..._sampling import sample_latents, to_uint8


def _text(model: Any, prompts: list[str], processor: str | None, device: Any) -> torch.Tensor:
    from . import encode_text

    enc = get_encoder(model, "text_encoder", device)
    if enc is None or processor is None:
        if any(prompts):
            raise ValueError("render: prompts need the model's text encoder and --processor DIR")
        return torch.zeros(len(prompts), 1, model.config.text_dim, device=device)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(processor, local_files_only=True)
    t = tok(prompts, max_length=64, padding="max_length", truncation=True, return_tensors="pt")
    return encode_text(enc, t["input_ids"].to(device), t["attention_mask"].to(device))


def render_clips(spec: Any, model: Any, request: RenderRequest) -> np.ndarray:
    """uint8 ``[F, H, B * W, 3]``: a clip of ``request.frames`` x ``height`` x ``width`` pixels
    per prompt, side by side, decoded through the model's VAE."""
    from . import vae_factors

    device = next(model.parameters()).device
    vae = get_encoder(model, "vae", device)
    if vae is None:
        raise ValueError("render: this checkpoint has no VAE to decode its latents")
    ft, fs = vae_factors(vae)
    f, h, w = request.frames, request.height, request.width
    lat = (vae.config.z_dim, 1 + (f - 1) // ft, h // fs, w // fs)
    cond = _text(model, list(request.prompts), request.processor, device)
    z = sample_latents(
        spec, model, request.flow_matching, cond, lat, steps=request.steps,
        method=request.method, guidance=request.guidance, seed=request.seed,
    )  # fmt: skip
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    video = vae.decode(z * std + mean).sample  # [B, 3, F, H, W]
    return np.concatenate(list(to_uint8(video).transpose(0, 2, 3, 4, 1)), axis=2)  # [F,H,BW,3]
