"""``wan``: Wan2.1 / Wan2.2 text-to-video on diffusers' ``WanTransformer3DModel`` (flow matching).

Presets: ``1.3b`` and ``14b`` (Wan2.1 T2V) and ``2.2-5b`` (Wan2.2 TI2V-5B: 48 latent channels,
same class). Training follows Wan's rectified-flow parameterisation (objective options
``convention: rectified_flow``, ``shift: 5``): ``x_t = (1 - s) x + s noise``, the network sees the
timestep ``1000 s`` and predicts ``noise - x``.

Conditions and latents come precomputed (``text_embeds [B, L, text_dim]`` umT5 states with
zeros after each prompt's end, ``latents [B, C, F', H', W']`` normalised with the VAE's
``latents_mean``/``latents_std``), or are encoded on the fly by frozen encoders attached with
:func:`lmms_models.attach_encoder`: ``"text_encoder"`` (transformers' ``UMT5EncoderModel``) from
``input_ids``/``attention_mask`` and ``"vae"`` (diffusers' ``AutoencoderKLWan``, posterior mean)
from ``pixel_values [B, 3, F, H, W]``. The CFG null condition is all-zero text states (every
position padding). Ulysses SP over video tokens: :data:`SP_PLAN` (applied by lmms-parallel).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._capabilities import RenderRequest, Renders
from ..._diffusion import (
    DiffusionSpec,
    call_denoiser,
    on_device,
    require_diffusers,
    save_encoders,
)
from ..._registry import register_model

__all__ = ["SP_PLAN", "WanSpec", "encode_text", "encode_video"]

_COMMON = dict(patch_size=[1, 2, 2], attention_head_dim=128, text_dim=4096, freq_dim=256,
               cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
               rope_max_seq_len=1024)  # fmt: skip


def _preset(channels: int, **shape: Any) -> dict[str, Any]:
    """A published Wan transformer: ``channels`` latent channels in and out, its own ``shape``."""
    return dict(_COMMON, in_channels=channels, out_channels=channels, **shape)


PRESETS = {
    "1.3b": _preset(16, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "14b": _preset(16, num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "2.2-5b": _preset(48, num_attention_heads=24, ffn_dim=14336, num_layers=30),
}
TEXT_LEN = 512  # umT5 context Wan trains with (FLOPs of the cross-attention)


#: Ulysses SP over the video tokens (lmms_parallel's sequence-parallel styles, applied by
#: ``ModelSpec.install_sp``): the tokens are split after the patch embedding; each self-attention
#: trades tokens for heads after its q/k norms (over all heads) and v projection, so diffusers'
#: processor applies the full-length 3-D RoPE and attends over the whole clip with ``heads/sp``
#: heads, and trades back before its output projection; cross-attention (local queries, the
#: replicated text) needs no exchange; the tokens are gathered before the output norm, and the
#: replicated head's gradient is shared over the group. Why not diffusers' own context
#: parallelism: it needs an accelerator (SP 2 == SP 1 could not be checked on CPU), and its
#: output gather's backward is meant for inference.
SP_PLAN = {
    "blocks.0": "sp_split_tokens",  # hidden_states [B, N, C] -> [B, N/sp, C]
    "blocks.*.attn1.norm_q": "sp_tokens_to_heads",  # [B, N/sp, H*D] -> [B, N, H/sp*D]
    "blocks.*.attn1.norm_k": "sp_tokens_to_heads",
    "blocks.*.attn1.to_v": "sp_tokens_to_heads",
    "blocks.*.attn1.to_out.0": "sp_heads_to_tokens",  # input [B, N, H/sp*D] -> [B, N/sp, H*D]
    "blocks.*.attn1": "sp_local_heads",  # attn1.heads = H/sp
    "norm_out": "sp_gather_tokens",  # input [B, N/sp, C] -> [B, N, C]
    "proj_out": "sp_replicated_grad",  # every rank computes the whole output: 1/sp of its grad
}


@register_model("wan")
class WanSpec(DiffusionSpec, Renders):
    processor_family = "wan"
    folder_class_names = ("WanTransformer3DModel",)  # diffusers' transformer folder
    presets = PRESETS
    objective_defaults = {"convention": "rectified_flow", "shift": 5.0}  # noqa: RUF012
    sp_plan = SP_PLAN
    synthetic_kind = "clips"
    placeable_encoders = ("text_encoder",)
    encoder_classes = {  # noqa: RUF012
        "vae": ("diffusers", "AutoencoderKLWan", ""),
        "text_encoder": ("transformers", "UMT5EncoderModel", "UMT5Config"),
    }

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        conf = dict(
            patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
        )  # fmt: skip
        conf.update(overrides)
        return conf

    def encoder_blocks(self, name: str, encoder: nn.Module) -> list[nn.Module]:
        """umT5's blocks (``frozen_encoders: shard | offload``); the VAE (~0.1B) stays
        replicated."""
        return list(encoder.encoder.block) if name == "text_encoder" else []

    def make_config(self, config: dict[str, Any]) -> Any:
        """The ``FrozenDict`` config diffusers' class would hold (via a meta-device build)."""
        conf = self._transformer_config(config)
        with torch.device("meta"):
            model = require_diffusers().WanTransformer3DModel(**conf)
        return model.config

    def new_denoiser(self, config: dict[str, Any], device: torch.device) -> nn.Module:
        """``WanTransformer3DModel`` from a config dict."""
        cls = require_diffusers().WanTransformer3DModel
        with torch.device(device):
            model = cls(**self._transformer_config(config))
        if device.type == "meta":  # the RoPE tables (non-persistent buffers) stay real
            rope = model.rope
            model.rope = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
        return model

    def load_denoiser(self, folder: str) -> nn.Module:
        """``WanTransformer3DModel`` from a local diffusers folder (strict weights)."""
        model = self.new_denoiser(self.pretrained_config(folder), torch.device("cpu"))
        model.load_state_dict(_read_weights(folder), strict=True)
        return model

    def _transformer_config(self, config: dict[str, Any]) -> dict[str, Any]:
        conf, _ = self.split_encoders(config)
        return {k: v for k, v in conf.items() if not k.startswith("_") and k != "model_type"}

    def vae_factors(self, vae: dict[str, Any]) -> tuple[int, int, int]:
        temporal = 2 ** sum(bool(x) for x in vae.get("temperal_downsample", [False, True, True]))
        spatial = 2 ** (len(vae.get("dim_mult", [1, 2, 4, 4])) - 1)
        return temporal, spatial, int(vae.get("z_dim", 16))

    # ---------------------------------------------------------------- objective hooks
    def encode_batch(
        self, encoders: dict[str, nn.Module], batch: dict[str, Any], device: Any
    ) -> tuple[torch.Tensor, Any]:
        x1 = self.batch_latents(encoders, batch, device)
        if "text_embeds" in batch:
            text = batch["text_embeds"].to(device, torch.float32)
        else:
            enc = on_device(encoders, "text_encoder", device)
            if enc is None:
                raise ValueError(
                    "wan: input_ids need a text encoder (model config key 'text_encoder')"
                )
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            text = encode_text(enc, ids, mask)
        return x1, text

    def encode_pixels(self, vae: nn.Module | None, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [B, 3, F, H, W]`` through Wan's VAE (normalised latents)."""
        if vae is None:
            raise ValueError("wan: pixel_values need a VAE (model config key 'vae')")
        return encode_video(vae, pixels)

    def drop_condition(self, model: nn.Module, cond: Any, drop: torch.Tensor) -> Any:
        return cond * (~drop).to(cond.dtype)[:, None, None]

    def null_condition(self, model: nn.Module, batch_size: int, device: Any) -> Any:
        text_dim = model.config.text_dim
        return torch.zeros(batch_size, 1, text_dim, device=device)

    def denoise(
        self, model: nn.Module, x_t: torch.Tensor, timestep: torch.Tensor, cond: Any
    ) -> torch.Tensor:
        dtype = model.proj_out.weight.dtype
        out = call_denoiser(
            model,
            hidden_states=x_t.to(dtype), timestep=timestep, encoder_hidden_states=cond.to(dtype),
            return_dict=False,
        )[0]  # fmt: skip
        return out

    def export_writer(self, model: nn.Module) -> Any:
        """lmms_parallel.export_hf hands the gathered weights as ``state_dict=``, which
        diffusers' ``save_pretrained`` does not take: written in diffusers' own layout."""
        return functools.partial(_save_pretrained, model)

    def render(self, model: nn.Module, request: RenderRequest) -> Any:
        """One clip per prompt, side by side (:func:`._render.render_clips`)."""
        from ._render import render_clips

        return render_clips(self, model, request)

    def check_sp(self, config: Any, sp: int) -> None:
        """Ulysses SP over the video tokens needs the attention heads divisible by ``sp``."""
        heads = None if config is None else config["num_attention_heads"]
        if heads is not None and heads % sp:
            raise ValueError(
                f"sp_ulysses_degree {sp} must divide wan's {heads} attention heads "
                "(each SP rank attends with whole heads)"
            )

    def tokens_per_sample(self, config: Any, latent_shape: Sequence[int]) -> int:
        pt, ph, pw = config.patch_size
        f, h, w = latent_shape[-3:]
        return (f // pt) * (h // ph) * (w // pw)

    # ---------------------------------------------------------------- engine hooks
    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.proj_out

    def matmul_params(self, config: Any) -> int:
        """Per video token: self-attention q/k/v/o, cross-attention q/o, FFN, both norms' weights,
        patch embedding and output projection (cross-attention k/v run on the text tokens)."""
        d = config.num_attention_heads * config.attention_head_dim
        patch = int(torch.tensor(config.patch_size).prod())
        block = 4 * (d * d + d) + 2 * (d * d + d) + 2 * d * config.ffn_dim + config.ffn_dim + d
        block += 4 * d + (2 * d if config.cross_attn_norm else 0)  # q/k norms, norm2 affine
        embed = config.in_channels * patch * d + d
        head = d * config.out_channels * patch + config.out_channels * patch
        return config.num_layers * block + embed + head

    def attention_shape(self, config: Any) -> tuple[int, int]:
        return config.num_layers, config.num_attention_heads * config.attention_head_dim

    def extra_flops(self, config: Any, seq_lens: Sequence[int]) -> float:
        """Cross-attention over ``TEXT_LEN`` text tokens (scores and values, per video token) and
        its k/v projections of the text, plus the text embedder, once per sample."""
        layers, d = self.attention_shape(config)
        scores = 12.0 * layers * d * TEXT_LEN * sum(seq_lens)
        text = 6.0 * TEXT_LEN * (layers * 2 * d * d + config.text_dim * d + d * d)
        return scores + text * len(seq_lens)


def vae_factors(vae: nn.Module) -> tuple[int, int]:
    """``(temporal, spatial)`` compression of an ``AutoencoderKLWan`` from its structure."""
    c = vae.config
    return 2 ** sum(bool(x) for x in c.temperal_downsample), 2 ** (len(c.dim_mult) - 1)


def encode_video(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents ``[B, z, 1 + (F-1)/t, H/s, W/s]`` of ``pixels [B, 3, F, H, W]`` in
    [-1, 1]: the posterior mean, ``(z - latents_mean) / latents_std`` (Wan's pipeline)."""
    with torch.no_grad():
        z = vae.encode(pixels.to(next(vae.parameters()).dtype)).latent_dist.mean.float()
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def encode_text(encoder: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """umT5 states ``[B, L, D]`` with zeros after each prompt's end (Wan's padding rule)."""
    with torch.no_grad():
        states = encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
    return states * mask[..., None].to(states.dtype)


def _save_pretrained(
    model: nn.Module, out_dir: str, *, state_dict: dict[str, Any] | None = None, **_: Any
) -> None:
    """``config.json`` + ``diffusion_pytorch_model.safetensors`` (``from_pretrained`` loads it)."""
    from safetensors.torch import save_file

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_config(out_dir)
    sd = state_dict if state_dict is not None else model.state_dict()
    tensors = {k: v.detach().contiguous() for k, v in sd.items()}
    save_file(tensors, str(Path(out_dir) / "diffusion_pytorch_model.safetensors"))
    save_encoders(model, out_dir)


def _read_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every ``*.safetensors`` shard of a diffusers model folder (no ``accelerate`` needed, which
    diffusers' ``from_pretrained`` requires for Wan's fp32-kept modules)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
