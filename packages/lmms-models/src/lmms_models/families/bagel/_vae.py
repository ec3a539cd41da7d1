"""BAGEL's frozen VAE: the FLUX autoencoder (``ae.safetensors``) as a diffusers ``AutoencoderKL``.

The public BAGEL release ships FLUX.1's autoencoder in FLUX's own parameter names
(``encoder.down.N.block.M.*``, ``mid.attn_1.{q,k,v,proj_out}`` as 1x1 convolutions, ...). lmms runs
it as diffusers' ``AutoencoderKL`` (the same network: ResNet blocks, one mid attention, asymmetric
padding before each stride-2 convolution, no quant convolutions), so the checkpoint is renamed on
load (:func:`flux_to_diffusers`); :func:`diffusers_to_flux` is its inverse (tests, and writing a
FLUX-layout file). :data:`FLUX_VAE_CONFIG` is the diffusers config of FLUX's VAE (16 latent
channels, /8, ``scaling_factor`` 0.3611, ``shift_factor`` 0.1159).

Name map (FLUX -> diffusers), ``n`` = number of resolutions:

| FLUX | diffusers |
| --- | --- |
| ``encoder.down.i.block.j`` / ``.downsample.conv`` | ``encoder.down_blocks.i.resnets.j`` / ``.downsamplers.0.conv`` |
| ``decoder.up.i.block.j`` / ``.upsample.conv`` | ``decoder.up_blocks.(n-1-i).resnets.j`` / ``.upsamplers.0.conv`` |
| ``{encoder,decoder}.mid.block_1`` / ``block_2`` | ``*.mid_block.resnets.0`` / ``resnets.1`` |
| ``*.mid.attn_1.{norm,q,k,v,proj_out}`` | ``*.mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}`` (weights ``[C, C, 1, 1] -> [C, C]``) |
| ``nin_shortcut`` / ``norm_out`` | ``conv_shortcut`` / ``conv_norm_out`` |
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["FLUX_VAE_CONFIG", "diffusers_to_flux", "flux_to_diffusers", "load_flux_vae",
           "load_vae_folder"]  # fmt: skip

FLUX_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}

_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_ATTN_INV = {v: k for k, v in _ATTN.items()}


def _levels(state: dict[str, torch.Tensor], side: str, word: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.match(rf"{side}\.{word}\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


#: FLUX name parts and their diffusers ``AutoencoderKL`` names, in the order they are applied;
#: ``{i}`` is a block index, ``{r}`` the same block counted from the other end (the decoder's up
#: blocks run in reverse order in diffusers)
_RENAMES: list[tuple[str, str]] = [
    ("encoder.down.{i}.block.", "encoder.down_blocks.{i}.resnets."),
    ("encoder.down.{i}.downsample.", "encoder.down_blocks.{i}.downsamplers.0."),
    ("decoder.up.{i}.block.", "decoder.up_blocks.{r}.resnets."),
    ("decoder.up.{i}.upsample.", "decoder.up_blocks.{r}.upsamplers.0."),
    (".mid.block_1.", ".mid_block.resnets.0."),
    (".mid.block_2.", ".mid_block.resnets.1."),
    *((f".mid.attn_1.{a}.", f".mid_block.attentions.0.{b}.") for a, b in _ATTN.items()),
    (".nin_shortcut.", ".conv_shortcut."),
    (".norm_out.", ".conv_norm_out."),
]


def _rename(key: str, rules: list[tuple[str, str]], n_up: int) -> str:
    """``key`` through ``rules`` (``(from, to)`` pairs of :data:`_RENAMES`): indexed parts at the
    start of the name, the others wherever they occur."""
    for src, dst in rules:
        if "{" not in src:
            key = key.replace(src, dst)
            continue
        reverse = "{r}" in src + dst
        pattern = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)").replace(r"\{r\}", r"(\d+)")

        def index(m: re.Match[str], dst: str = dst, reverse: bool = reverse) -> str:
            i = int(m.group(1))
            j = str(n_up - 1 - i if reverse else i)
            return dst.replace("{i}", j).replace("{r}", j)

        key = re.sub(pattern, index, key)
    return key


def flux_to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FLUX-layout autoencoder state dict in diffusers ``AutoencoderKL`` names (an ``ae.`` /
    ``vae.`` prefix is dropped); the attention's 1x1 convolutions become linear weights."""
    state = {re.sub(r"^(ae|vae|first_stage_model)\.", "", k): v for k, v in state.items()}
    n_up = _levels(state, "decoder", "up")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        new = _rename(key, _RENAMES, n_up)
        if ".attentions.0.to_" in new and new.endswith(".weight") and value.ndim == 4:
            value = value[:, :, 0, 0]
        out[new] = value
    return out


_INVERSE = [(d, f) for f, d in _RENAMES]


def diffusers_to_flux(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`flux_to_diffusers` (diffusers ``AutoencoderKL`` -> FLUX names)."""
    n_up = _levels(state, "decoder", "up_blocks")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        k = _rename(key, _INVERSE, n_up)
        if ".mid.attn_1." in k and k.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]
        out[k] = value
    return out


def load_flux_vae(path: str | Path, config: dict[str, Any] | None = None) -> nn.Module:
    """A diffusers ``AutoencoderKL`` (``config``, default :data:`FLUX_VAE_CONFIG`) holding the
    FLUX-layout weights of the safetensors file ``path`` (every key must map: strict load)."""
    from safetensors.torch import load_file

    from ..._diffusion import require_diffusers

    diffusers = require_diffusers()
    vae = diffusers.AutoencoderKL(**(config or FLUX_VAE_CONFIG))
    try:
        missing, unexpected = vae.load_state_dict(
            flux_to_diffusers(load_file(str(path))), strict=False
        )
    except RuntimeError as exc:  # shapes differ
        raise ValueError(f"{path}: not a FLUX autoencoder of this config: {exc}") from None
    if missing or unexpected:
        raise ValueError(
            f"{path}: not a FLUX autoencoder of this config (missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]})"
        )
    return vae.eval().requires_grad_(False)


def load_vae_folder(source: str | Path) -> nn.Module:
    """A local VAE: a diffusers folder (``config.json``), a folder holding FLUX's
    ``ae.safetensors`` (config: an ``ae_config.json`` there, else :data:`FLUX_VAE_CONFIG`) or the
    ``ae.safetensors`` file itself."""
    from ..._diffusion import require_diffusers

    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        diffusers = require_diffusers()
        return diffusers.AutoencoderKL.from_pretrained(str(path), local_files_only=True)
    file = path / "ae.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"bagel vae {source!r}: no diffusers config.json and no FLUX ae.safetensors"
        )
    conf_file = file.parent / "ae_config.json"
    conf = json.loads(conf_file.read_text()) if conf_file.is_file() else None
    return load_flux_vae(file, conf)
