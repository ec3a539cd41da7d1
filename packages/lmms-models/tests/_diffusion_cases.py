"""Inputs the diffusion-family tests share."""

from __future__ import annotations

from typing import Any

import torch


def sit_pixel_batch() -> dict[str, Any]:
    """Four 8x8 RGB images of classes 0-3 with their noise seeds: a SiT latent batch on pixels."""
    g = torch.Generator().manual_seed(2)
    return {
        "pixel_values": torch.randn(4, 3, 8, 8, generator=g),
        "class_labels": torch.tensor([0, 1, 2, 3]),
        "noise_seed": torch.tensor([11, 12, 13, 14]),
        "num_loss_tokens": 4,
    }
