"""Render an image from a prompt with a BAGEL model: Euler steps of the learned velocity field.

The prompt's parts are packed with one ``vae_gen`` slot of the requested latent shape (a noised
span, exactly as in training); starting from Gaussian noise at noise level 1 the latents move
``x <- x - dt * v(x, t)`` down to level 0 (``v`` predicts ``noise - data``). No KV cache: every
step runs the whole (short) prompt again, which is what a tiny CPU model can afford; classifier-free
guidance mixes the velocity with that of an empty prompt when ``guidance > 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._pack import pack_samples, patchify, unpatchify

__all__ = ["generate_latents"]


@torch.no_grad()
def generate_latents(
    model: nn.Module,
    prompt: Sequence[dict[str, Any]],  # text / vit / vae_cond parts before the image
    shape: tuple[int, int, int],  # latents [C, h, w]
    *,
    start_of_image: int,
    end_of_image: int,
    steps: int = 30,
    guidance: float = 1.0,
    null_prompt: Sequence[dict[str, Any]] = (),
    seed: int = 0,
) -> torch.Tensor:  # [C, h, w]
    """Latents of one image generated for ``prompt`` (see the module docstring)."""
    cfg = model.config
    dev = next(model.parameters()).device
    p = cfg.latent_patch_size
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dev)
    placeholder = {"type": "vae_gen", "latents": torch.zeros(shape)}
    rows = [pack_samples([[*prompt, placeholder]], cfg, start_of_image=start_of_image,
                         end_of_image=end_of_image)]  # fmt: skip
    if guidance != 1.0:
        rows.append(pack_samples([[*null_prompt, placeholder]], cfg,
                                 start_of_image=start_of_image, end_of_image=end_of_image))  # fmt: skip
    from ._pack import batch_to

    rows = [batch_to(r, dev) for r in rows]
    levels = torch.linspace(1.0, 0.0, steps + 1, device=dev)
    for i in range(steps):
        t, dt = levels[i], levels[i] - levels[i + 1]
        tok = patchify(x, p)
        time = t.expand(tok.shape[0])
        vs = [model(row, tok, time)[1] for row in rows]
        v = vs[0] if len(vs) == 1 else vs[1] + guidance * (vs[0] - vs[1])
        x = x - dt * unpatchify(v.float(), shape[0], shape[1] // p, shape[2] // p, p)
    return x
