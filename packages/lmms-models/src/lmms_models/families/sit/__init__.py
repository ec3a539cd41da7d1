"""``sit``: class-conditional SiT/DiT on VAE latents (or pixels), trained with flow matching.

Presets ``S/2 .. XL/8`` are the SiT paper's sizes (S: 384 x 12, B: 768 x 12, L: 1024 x 24,
XL: 1152 x 28) at patch 2, 4 or 8 on 32 x 32 x 4 latents (256 px through the SD VAE). The model is
:class:`SiT` (written here; see its module for why not diffusers' DiT class). Records are an image
and a class label; latents come precomputed (``latents``) or are encoded on the fly from
``pixel_values`` by a frozen VAE attached with :func:`lmms_models.attach_encoder` (``"vae"``: a
diffusers ``AutoencoderKL``; its latent mean times ``scaling_factor``, deterministic). Without a
VAE the ``pixel_values`` are the latents (pixel-space SiT: the tiny CPU example).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..._capabilities import RenderRequest, Renders
from ..._diffusion import DiffusionSpec, call_denoiser
from ..._registry import register_model
from ...parts.latent import encode_latents
from ._model import SiT, SiTBlock, SiTConfig, sincos_2d, timestep_features

__all__ = ["SiT", "SiTBlock", "SiTConfig", "SiTSpec", "sincos_2d", "timestep_features"]

_SIZES = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}
PRESETS = {
    f"{size}/{p}": {"hidden_size": h, "depth": d, "num_heads": n, "patch_size": p}
    for size, (h, d, n) in _SIZES.items()
    for p in (2, 4, 8)
}


@register_model("sit")
class SiTSpec(DiffusionSpec, Renders):
    processor_family = "sit"
    presets = PRESETS
    objective_defaults = {"convention": "sit"}  # noqa: RUF012
    synthetic_kind = "shapes"
    encoder_classes = {"vae": ("diffusers", "AutoencoderKL", "")}  # noqa: RUF012

    def render(self, model: nn.Module, request: RenderRequest) -> Any:
        """A grid of samples, one row per class (:func:`._render.render_grid`)."""
        from ._render import render_grid

        return render_grid(self, model, request)

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        conf = dict(
            model_type="sit", input_size=8, patch_size=2, in_channels=3, hidden_size=64,
            depth=2, num_heads=4, num_classes=4, learn_sigma=False,
        )  # fmt: skip
        conf.update(overrides)
        return conf

    def make_config(self, config: dict[str, Any]) -> SiTConfig:
        conf, _ = self.split_encoders(config)
        if conf.setdefault("model_type", "sit") != "sit":
            raise ValueError(f"config says model_type={conf['model_type']!r}; sit builds 'sit'")
        return SiTConfig(**conf)

    def num_classes(self, config: dict[str, Any]) -> int | None:
        """The label embedding's classes (one more row holds the null class of CFG)."""
        return self.make_config(config).num_classes

    def new_denoiser(self, config: dict[str, Any], device: torch.device) -> nn.Module:
        """A :class:`SiT` from a config dict."""
        with torch.device(device):
            return SiT(self.make_config(config))

    def load_denoiser(self, folder: str) -> nn.Module:
        """A :class:`SiT` from ``config.json`` + ``model.safetensors`` (the trainer's export)."""
        return SiT.from_pretrained(folder)

    def vae_factors(self, vae: dict[str, Any]) -> tuple[int, int, int]:
        blocks = vae.get("block_out_channels", (64,))
        return 1, 2 ** (len(blocks) - 1), int(vae.get("latent_channels", 4))

    # ---------------------------------------------------------------- objective hooks
    def encode_batch(
        self, encoders: dict[str, nn.Module], batch: dict[str, Any], device: Any
    ) -> tuple[torch.Tensor, Any]:
        x1 = self.batch_latents(encoders, batch, device)
        return x1, batch["class_labels"].to(device, torch.int64)

    def encode_pixels(self, vae: nn.Module | None, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [B, 3, H, W]`` through the VAE; without one SiT runs in pixel space."""
        return pixels if vae is None else encode_latents(vae, pixels)

    def drop_condition(self, model: nn.Module, cond: Any, drop: torch.Tensor) -> Any:
        return torch.where(drop, torch.full_like(cond, model.config.num_classes), cond)

    def null_condition(self, model: nn.Module, batch_size: int, device: Any) -> Any:
        return torch.full((batch_size,), model.config.num_classes, device=device)

    def denoise(
        self, model: nn.Module, x_t: torch.Tensor, timestep: torch.Tensor, cond: Any
    ) -> torch.Tensor:
        out = call_denoiser(model, x_t.to(model.x_embedder.proj.weight.dtype), timestep, cond)
        return out[:, : x_t.shape[1]]  # learn_sigma checkpoints: the variance half is unused

    def tokens_per_sample(self, config: Any, latent_shape: Sequence[int]) -> int:
        p = config.patch_size
        return (latent_shape[-2] // p) * (latent_shape[-1] // p)

    # ---------------------------------------------------------------- engine hooks
    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.final_layer

    def matmul_params(self, config: Any) -> int:
        h, p, c = config.hidden_size, config.patch_size, config.in_channels
        block = 4 * h * h + 4 * h + 2 * h * config.mlp_hidden + config.mlp_hidden + h
        out = p * p * config.out_channels
        return config.depth * block + (c * p * p * h + h) + (h * out + out)

    def attention_shape(self, config: Any) -> tuple[int, int]:
        return config.depth, config.hidden_size

    def extra_flops(self, config: Any, seq_lens: Sequence[int]) -> float:
        """The conditioning path runs once per sample: timestep MLP, adaLN of every block and
        of the final layer."""
        h = config.hidden_size
        per_sample = 256 * h + h * h + config.depth * 6 * h * h + 2 * h * h
        return 6.0 * per_sample * len(seq_lens)
