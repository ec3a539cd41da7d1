"""``bagel``: BAGEL, unified image understanding and generation (Mixture-of-Transformers).

A Qwen2.5 decoder whose every layer has a second set of weights for generation (VAE latent)
tokens, a SigLIP NaViT encoder for understanding images at native resolution, and VAE latent
tokens trained by flow matching; text by cross-entropy. The model is :class:`Bagel` (written here
with the public checkpoint's parameter names, see ``_model.py``); packed rows come from
:func:`pack_samples` (``_pack.py``: per-span attention rules in ``_mask.py``); the objective is
``ce_flow_matching`` (lmms_models.objectives). Preset ``7b-mot``: BAGEL-7B-MoT (14B total, 7B
active). Docs: docs/bagel.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._registry import register_model
from ..._spec import ModelSpec
from ._mask import CAUSAL, FULL, NOISE, PackLayout, dense_mask, span_attention
from ._model import Bagel, BagelConfig, LLMConfig, MoTDecoderLayer, SiglipEncoderLayer, ViTConfig
from ._pack import batch_to, pack_samples, patchify, pixel_space_latents, unpatchify

__all__ = [
    "CAUSAL",
    "FULL",
    "NOISE",
    "Bagel",
    "BagelConfig",
    "BagelSpec",
    "LLMConfig",
    "MoTDecoderLayer",
    "PackLayout",
    "SiglipEncoderLayer",
    "ViTConfig",
    "batch_to",
    "dense_mask",
    "pack_samples",
    "patchify",
    "pixel_space_latents",
    "span_attention",
    "unpatchify",
]

PRESETS: dict[str, dict[str, Any]] = {
    # BAGEL-7B-MoT: Qwen2.5-7B (+ QK-norm) x 2 experts, SigLIP so400m/14 minus its last layer,
    # FLUX VAE latents (16 channels, /8) in 2 x 2 patches, 64 x 64 latent position table.
    "7b-mot": {
        "llm": {},
        "vit": {},
        "latent_channels": 16,
        "vae_downsample": 8,
        "latent_patch_size": 2,
        "max_latent_size": 64,
        "vit_max_num_patch_per_side": 70,
    }
}


@register_model("bagel")
class BagelSpec(ModelSpec):
    """The engine's view of BAGEL. Not a transformers class: :meth:`build` makes a :class:`Bagel`."""

    processor_family = "bagel"
    presets = PRESETS
    default_objective = "ce_flow_matching"
    supports_liger = False  # its RMSNorm/SwiGLU are its own modules (no Liger plan yet)
    media_keys = ("vit_patches", "vae_latents")

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "llm": dict(
                vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, qk_norm=True,
            ),
            "vit": dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                patch_size=4, image_size=64,
            ),
            "latent_channels": 4, "vae_downsample": 8, "latent_patch_size": 2,
            "max_latent_size": 16, "vit_max_num_patch_per_side": 16,
        }  # fmt: skip
        for k, v in overrides.items():
            conf[k] = {**conf[k], **v} if isinstance(v, dict) and k in ("llm", "vit") else v
        return conf

    def make_config(self, config: dict[str, Any]) -> BagelConfig:
        return BagelConfig.from_dict({k: v for k, v in config.items() if k != "vae"})

    def attach_vae(self, model: nn.Module, source: dict[str, Any] | str) -> None:
        """Attach a frozen diffusers ``AutoencoderKL`` (config dict: seeded random weights for
        tiny runs; str: a local folder, e.g. the FLUX VAE in diffusers layout) outside the
        trained module tree (not in the state dict, FSDP units or checkpoints)."""
        from ..._diffusion import attach_encoder, require_diffusers

        diffusers = require_diffusers()
        if isinstance(source, str):
            vae = diffusers.AutoencoderKL.from_pretrained(source, local_files_only=True)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                vae = diffusers.AutoencoderKL(**source)
        attach_encoder(model, "vae", vae)

    def pixel_encoder(self, model: nn.Module) -> Any:
        """``pixels [3, H, W] in [-1, 1] -> latents [C, H/f, W/f]`` through the attached VAE
        (posterior mean, ``(z - shift_factor) * scaling_factor`` as the FLUX VAE is used), or None
        without one (``pack_samples(encode=...)``)."""
        from ..._diffusion import encoders_of
        from ..sit import encode_latents

        vae = encoders_of(model).get("vae")
        if vae is None:
            return None
        return lambda px: encode_latents(vae.to(px.device), px[None])[0]

    def latent_decoder(self, model: nn.Module) -> Any:
        """``latents [C, h, w] -> pixels [3, H, W]``: the inverse scaling, then the VAE decoder."""
        from ..._diffusion import encoders_of

        vae = encoders_of(model).get("vae")
        if vae is None:
            return None
        shift = getattr(vae.config, "shift_factor", None) or 0.0

        @torch.no_grad()
        def dec(z: torch.Tensor) -> torch.Tensor:
            z = z[None] / vae.config.scaling_factor + shift
            return vae.to(z.device).decode(z.to(next(vae.parameters()).dtype)).sample[0].float()

        return dec

    def build(
        self,
        *,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "auto",
        vision_attn_backend: str | None = None,
        **_: Any,
    ) -> nn.Module:
        """A :class:`Bagel` from a config dict, or a local folder with ``config.json`` (this
        spec's dict) and ``model.safetensors`` / ``ema.safetensors`` (the public layout)."""
        if (config is None) == (pretrained is None):
            raise ValueError("give exactly one of config= or pretrained=")
        if pretrained is not None:
            config = json.loads((Path(pretrained) / "config.json").read_text())
        with torch.device(device):
            model = Bagel(self.make_config(config))  # type: ignore[arg-type]
        model.vit_model.attn_backend = vision_attn_backend or attn_backend
        if pretrained is not None and torch.device(device).type != "meta":
            from safetensors.torch import load_file

            folder = Path(pretrained)
            name = next(
                (n for n in ("model.safetensors", "ema.safetensors") if (folder / n).is_file()),
                None,
            )
            if name is None:
                raise FileNotFoundError(f"{folder}: no model.safetensors or ema.safetensors")
            model.load_state_dict(load_file(str(folder / name)))
        model = model.to(dtype)
        vae = config.get("vae")  # type: ignore[union-attr]
        if (
            pretrained is not None
            and vae is None
            and (Path(pretrained) / "vae" / "config.json").is_file()
        ):
            vae = str(Path(pretrained) / "vae")
        if vae is not None:
            self.attach_vae(model, vae)
        return model

    def set_attention(self, model: nn.Module, **_: Any) -> dict[str, str]:
        return {}  # span attention is chosen per row (PackLayout.backend)

    # ---------------------------------------------------------------- objective hooks
    def latent_tokens(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``[C, H, W]`` latents -> ``[n, p*p*C]`` tokens."""
        return patchify(x, _cfg(model).latent_patch_size)

    def latent_image(
        self, model: nn.Module, tokens: torch.Tensor, like: torch.Tensor
    ) -> torch.Tensor:
        p = _cfg(model).latent_patch_size
        return unpatchify(tokens, like.shape[0], like.shape[1] // p, like.shape[2] // p, p)

    def mixed_forward(
        self, model: nn.Module, batch: dict[str, Any], tokens: torch.Tensor | None,
        time: torch.Tensor | None, loss_backend: str = "auto", sp_group: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        from ..._diffusion import call_denoiser

        return call_denoiser(
            model, batch, tokens, time, loss_backend=loss_backend, sp_group=sp_group
        )

    def packed_forward(self, model: nn.Module, batch: dict[str, Any], **_: Any) -> Any:
        raise NotImplementedError("bagel trains with objective: ce_flow_matching")

    # ---------------------------------------------------------------- engine hooks
    def base_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def text_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.language_model.model.layers)

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return model.vit_model

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.vit_model.vision_model.encoder.layers)

    def block_classes(self, model: nn.Module) -> list[type[nn.Module]]:
        return [MoTDecoderLayer, SiglipEncoderLayer]

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        return [model.language_model.model.embed_tokens]

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.language_model.lm_head

    def check_tp(self, config: Any, tp: int) -> None:
        if tp > 1:
            raise NotImplementedError("bagel: no tensor-parallel plan yet; use FSDP2")

    # ---------------------------------------------------------------- FLOPs
    def mot_flops(self, config: dict[str, Any], batch: dict[str, Any]) -> float:
        """Training FLOPs (6 x matmul parameters per token, + attention as executed) of a packed
        row: each token runs exactly one expert's weights, so the count is the same as one dense
        Qwen2.5 per token; attention counts the mask's allowed pairs (dense per sample, causal
        half for text), the ViT its own segments, plus the LM head on supervised text only."""
        cfg = self.make_config(config)
        llm, vit = cfg.llm, cfg.vit
        h, kv = llm.hidden_size, llm.num_key_value_heads * llm.head_dim
        per_tok = llm.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * llm.intermediate_size)
        t = int(batch["input_ids"].numel())
        flops = 6.0 * per_tok * t + 6.0 * h * llm.vocab_size * int(batch["num_ce_tokens"])
        layout: PackLayout = batch["layout"]
        pairs = sum(int(m.sum()) for m in layout.sample_masks())
        flops += 12.0 * llm.num_hidden_layers * h * pairs  # QK^T and PV, fwd + bwd
        vh = vit.hidden_size
        n_vit = int(batch["vit_patches"].shape[0])
        vit_tok = vit.num_hidden_layers * (4 * vh * vh + 2 * vh * vit.intermediate_size)
        vit_tok += vit.num_channels * vit.patch_size**2 * vh + vh * h + h * h  # embed, connector
        lens = (batch["vit_cu"][1:] - batch["vit_cu"][:-1]).tolist()
        flops += 6.0 * vit_tok * n_vit + 12.0 * vit.num_hidden_layers * vh * sum(
            n * n for n in lens
        )
        n_vae = int(batch["vae_pos"].numel())
        flops += 6.0 * (2 * cfg.patch_latent_dim * h + 256 * h + h * h) * n_vae
        return flops

    def tokens_per_sample(self, config: Any, lens: Sequence[int]) -> int:
        return int(sum(lens))


def _cfg(model: nn.Module) -> BagelConfig:
    return model.config
