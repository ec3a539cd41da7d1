"""DiffusionSpec: the ModelSpec of a diffusion transformer (a denoiser of latents), trained with
the ``flow_matching`` objective instead of a packed language-model forward.

A *latent batch* (what the data side yields for these families; one shape per batch, so
resolution/frame buckets never mix) is a dict:

| key | shape | meaning |
| --- | --- | --- |
| ``latents`` | ``[B, C, H, W]`` / ``[B, C, F, H, W]`` | VAE latents (precomputed), or |
| ``pixel_values`` | ``[B, 3, H, W]`` / ``[B, 3, F, H, W]`` in [-1, 1] | media to encode on the fly |
| ``class_labels`` | ``[B]`` int64 | SiT's condition |
| ``text_embeds``, ``text_mask`` | ``[B, L, D]``, ``[B, L]`` | Wan's condition (precomputed), or |
| ``input_ids``, ``attention_mask`` | ``[B, L]`` | text to encode on the fly |
| ``noise_seed`` | ``[B]`` int64 | seeds of each sample's noise/time/CFG draws (from the record) |
| ``cu_seqlens``, ``num_samples`` | ``[B+1]``, int | latent tokens per sample (FLOPs, throughput) |
| ``num_loss_tokens`` | int | ``B``: the flow-matching loss is normalised per sample |

The spec answers the objective's questions (:meth:`diffusion_inputs`, :meth:`drop_condition`,
:meth:`denoise`) and the engine's (blocks to shard and checkpoint, FLOPs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._flops import attention_flops
from ._spec import ModelSpec

__all__ = ["DiffusionSpec", "attach_encoder", "get_encoder", "require_diffusers"]


def require_diffusers() -> Any:
    """``import diffusers`` or an ImportError naming the extra that provides it."""
    try:
        import diffusers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "this model family needs diffusers: pip install 'lmms-models[diffusion]'"
        ) from exc
    return diffusers


class DiffusionSpec(ModelSpec):
    """Base class of the diffusion-transformer families (``sit``, ``wan``)."""

    default_objective: str = "flow_matching"
    objective_defaults: dict[str, Any] = {}  # noqa: RUF012 (read-only class table)

    # ---------------------------------------------------------------- objective hooks
    def diffusion_inputs(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """``(x1, condition)``: clean latents ``[B, ...]`` (fp32) and the family's condition."""
        raise NotImplementedError

    def drop_condition(self, model: nn.Module, cond: Any, drop: torch.Tensor) -> Any:
        """The condition with samples ``drop [B]`` replaced by the null condition (CFG)."""
        raise NotImplementedError

    def null_condition(self, model: nn.Module, batch_size: int, device: Any) -> Any:
        """The unconditional condition for ``batch_size`` samples (sampling with guidance)."""
        raise NotImplementedError

    def denoise(
        self,
        model: nn.Module,
        x_t: torch.Tensor,  # [B, ...] noised latents
        timestep: torch.Tensor,  # [B] what the network takes as its time input
        cond: Any,
        *,
        sp_group: Any = None,
    ) -> torch.Tensor:
        """The network's prediction ``[B, ...]`` (same shape as ``x_t``)."""
        raise NotImplementedError

    def tokens_per_sample(self, config: Any, latent_shape: Sequence[int]) -> int:
        """Transformer tokens of one sample with latents of ``latent_shape`` (no batch dim)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- engine hooks
    def packed_forward(self, model: nn.Module, batch: dict[str, Any], **_: Any) -> Any:
        raise NotImplementedError(
            f"{self.name} is a diffusion transformer: train it with objective: flow_matching "
            "(it has no packed language-model forward)"
        )

    def set_attention(self, model: nn.Module, **_: Any) -> dict[str, str]:
        return {}  # SDPA on dense [B, N] tokens: one shape per batch, no varlen needed

    def base_model(self, model: nn.Module) -> nn.Module:
        return model

    def text_model(self, model: nn.Module) -> nn.Module:
        return model

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return None

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        return []

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        return []

    def sp_slice_module(self, model: nn.Module) -> nn.Module:
        return model

    # ---------------------------------------------------------------- FLOPs
    def matmul_params(self, config: Any) -> int:
        """Parameters in a matmul per *token* (per-sample conditioning MLPs excluded)."""
        raise NotImplementedError

    def attention_shape(self, config: Any) -> tuple[int, int]:
        """``(layers, heads * head_dim)`` of the token self-attention."""
        raise NotImplementedError

    def extra_flops(self, config: Any, seq_lens: Sequence[int]) -> float:
        """FLOPs besides the token matmuls and self-attention (e.g. Wan's cross-attention)."""
        return 0.0

    def lm_flops(self, config: Any, seq_lens: Sequence[int], *, causal_half: bool = False) -> float:
        """Training FLOPs of the denoiser on samples of ``seq_lens`` tokens (bidirectional)."""
        layers, width = self.attention_shape(config)
        dense = 6.0 * self.matmul_params(config) * sum(seq_lens)
        return dense + attention_flops(layers, width, seq_lens) + self.extra_flops(config, seq_lens)


# ------------------------------------------------------------------------------ frozen encoders
_FROZEN = "_lmms_frozen_encoders"


def attach_encoder(model: nn.Module, name: str, encoder: nn.Module) -> None:
    """Attach a frozen encoder (VAE, text encoder) to ``model`` *outside* its module tree: it is
    not trained, not in the model's state dict, checkpoints or FSDP units, and follows the model's
    device on first use (:func:`get_encoder`). Its parameters are frozen and it runs in eval."""
    encoder.requires_grad_(False).eval()
    model.__dict__.setdefault(_FROZEN, {})[name] = encoder


def get_encoder(model: nn.Module, name: str, device: torch.device) -> nn.Module | None:
    """The frozen encoder ``name`` on ``device`` (moved there once), or None."""
    enc = model.__dict__.get(_FROZEN, {}).get(name)
    if enc is not None:
        p = next(iter(enc.parameters()), None)
        if p is not None and p.device != device:
            enc.to(device)
    return enc
