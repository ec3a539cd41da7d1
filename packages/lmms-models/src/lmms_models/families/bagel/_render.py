"""BAGEL's ``render``: one image per prompt, side by side."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._capabilities import RenderRequest
from ..._sampling import to_uint8
from ._sample import generate_latents


def render_images(spec: Any, model: Any, request: RenderRequest) -> np.ndarray:
    """uint8 ``[H, B * W, 3]``: each prompt goes through the family's data processor's chat markup
    (``request.build_processor``; its folder: ``request.processor``, else the export), then
    :func:`generate_latents` (Euler steps of the velocity field, classifier-free guidance
    against an empty prompt when ``guidance > 1``) and the model's VAE (or pixel-space stand-in)
    decodes. Size: ``request.height`` x ``request.width`` pixels."""
    conf = model.config
    if request.build_processor is None:
        raise ValueError("render: this family needs its data processor (build_processor)")
    proc = request.build_processor(
        request.processor or request.folder, **spec.processor_options(conf)
    )
    decode = spec.latent_decoder(model)
    if decode is None:
        raise ValueError("render: this checkpoint has no VAE to decode its latents")
    f = conf.vae_downsample * conf.latent_patch_size
    if request.height % f or request.width % f:
        raise ValueError(f"render: --height/--width must be multiples of {f}")
    shape = (
        conf.latent_channels,
        request.height // conf.vae_downsample,
        request.width // conf.vae_downsample,
    )
    tiles = []
    for i, prompt in enumerate(request.prompts):
        lat = generate_latents(
            model, proc.generation_prompt(prompt), shape, start_of_image=proc.start_of_image,
            end_of_image=proc.end_of_image, steps=request.steps, guidance=request.guidance,
            null_prompt=proc.generation_prompt(""), seed=request.seed + i,
        )  # fmt: skip
        tiles.append(to_uint8(decode(lat)).transpose(1, 2, 0))
    return np.concatenate(tiles, axis=1)
