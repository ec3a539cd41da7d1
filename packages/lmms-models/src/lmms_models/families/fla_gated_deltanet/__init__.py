"""flash-linear-attention's models (``fla.models``, HF-style classes) for pretraining from scratch:
``fla_gated_deltanet`` (``GatedDeltaNetForCausalLM``, Gated DeltaNet layers + SwiGLU MLPs).

The classes come from the ``flash-linear-attention`` package (``pip install 'lmms-models[fla]'``;
imported lazily, the ImportError names the extra). Its own layers are packing-exact with
``cu_seqlens`` but run Triton kernels only; lmms gives every ``GatedDeltaNet`` layer its packed
mixer (:func:`lmms_models._linear_attention.fla_gdn_packed_mixer`): the same parameters through
``lmms_kernels``' varlen ops (flash-linear-attention's kernels on CUDA, the plain-torch reference
on CPU), with Ulysses SP over heads (lmms-parallel's styles on each mixer's core: the mixin's
``linear_sp_plan``). On CPU the model's norms and MLP must be the plain-torch ones
(``fuse_norm: false``, ``fuse_swiglu: false``; the tiny config sets them); on CUDA the fused ones
work as upstream. The LM head's loss is lmms' fused linear cross-entropy, never fla's.

Hybrid fla configs (``attn: {...}``: softmax layers through flash-attn) are refused for now.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import _flops
from ..._build import build_hf_style
from ..._linear_attention import fla_gdn_packed_mixer
from ..._linear_spec import LinearAttentionMixin
from ..._registry import register_model
from ..._spec import ModelSpec

__all__ = ["FlaGatedDeltaNetSpec", "FlaSpec", "fla_models"]


@functools.cache
def fla_models() -> Any:
    """``fla.models`` (importing it registers its configs and models with transformers' Auto
    classes)."""
    try:
        import fla.models
    except ImportError as e:
        raise ImportError(
            "the fla_* model families need flash-linear-attention: pip install 'lmms-models[fla]'"
        ) from e
    return fla.models


class FlaSpec(LinearAttentionMixin, ModelSpec):
    """A causal LM of ``fla.models``: ``model.model`` with ``embeddings``, ``layers`` (each with
    its token mixer as ``.attn``) and ``norm``; ``model.lm_head``."""

    processor_family = "qwen3"  # any text tokenizer; the examples build a local Qwen-style one

    def make_config(self, config: dict[str, Any]) -> Any:
        cfg = dict(config)
        cls = getattr(fla_models(), self.config_class)
        model_type = cfg.pop("model_type", None)
        if model_type is not None and model_type != cls.model_type:
            raise ValueError(
                f"config says model_type={model_type!r} but spec {self.name!r} builds {cls.model_type!r}"
            )
        if cfg.get("attn"):
            raise NotImplementedError(
                f"{self.name}: hybrid configs (attn: ...) use fla's flash-attn layers; not supported"
            )
        return cls(**cfg)

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """With the classes of ``fla.models`` (no attention choice in their configs)."""
        from transformers import AutoConfig

        model_cls = getattr(fla_models(), self.model_class)
        return build_hf_style(
            self.make_config, model_cls, AutoConfig, source, device, dtype, sdpa_configs=None
        )

    def set_attention(self, model: nn.Module, **kwargs: Any) -> dict[str, str]:
        """Packed mixers as for every linear family (:class:`LinearAttentionMixin`), and every
        block's MLP through :func:`swiglu_mlp_forward` (plain torch off CUDA)."""
        names = super().set_attention(model, **kwargs)
        for block in self.decoder_blocks(model):
            block.mlp.forward = types.MethodType(swiglu_mlp_forward, block.mlp)
        return names

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        return [self.text_model(model).embeddings]

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return None


def swiglu_mlp_forward(self: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """fla's ``GatedMLP`` on CUDA as upstream; elsewhere, and under ``torch.compile`` (Inductor
    fuses it; fla's Triton wrappers are not traced), the same SwiGLU in plain torch (fla's
    ``swiglu`` is a Triton op even unfused)."""
    if x.is_cuda and not torch.compiler.is_compiling():
        return type(self).forward(self, x, **kwargs)
    if self.hidden_act not in ("swish", "silu"):
        raise NotImplementedError(f"fla GatedMLP with hidden_act={self.hidden_act!r} off CUDA")
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _mlp_width(cfg: Any) -> int:
    """fla's ``GatedMLP`` width: ``intermediate_size``, else 2/3 of ``hidden_ratio · h`` rounded
    up to a multiple of 256."""
    inter = _flops._get(cfg, "intermediate_size")
    if inter:
        return int(inter)
    inter = int(_flops._get(cfg, "hidden_size") * (_flops._get(cfg, "hidden_ratio") or 4) * 2 / 3)
    return 256 * ((inter + 255) // 256)


@register_model("fla_gated_deltanet")
class FlaGatedDeltaNetSpec(FlaSpec):
    # flash-linear-attention's own modules already run fused Triton norms (RMSNorm,
    # FusedRMSNormGated) and SwiGLU (GatedMLP) on the GPU: nothing for lmms' Liger plan to add
    config_class = "GatedDeltaNetConfig"
    model_class = "GatedDeltaNetForCausalLM"
    folder_model_types = ("gated_deltanet",)  # the fla package's own config
    packed_mixer = staticmethod(fla_gdn_packed_mixer)
    presets = {  # noqa: RUF012 (read-only class table)
        # ~1.3B parameters (fla's 1.3B recipe shape: 24 layers, width 2048, 6 heads of 256 with
        # expand_v 2, the gate; Qwen's 151k vocabulary here, hence a little above 1.3B)
        "1b": {
            "hidden_size": 2048,
            "num_hidden_layers": 24,
            "num_heads": 6,
            "head_dim": 256,
            "expand_v": 2.0,
            "use_gate": True,
            "use_short_conv": True,
            "conv_size": 4,
            "hidden_ratio": 4,
            "vocab_size": 151936,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
            "fuse_cross_entropy": False,
            "use_cache": False,
        },
    }

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_heads": 2,
            "num_v_heads": 4,
            "head_dim": 16,
            "expand_v": 1.0,
            "conv_size": 4,
            "intermediate_size": 128,
            "vocab_size": 1024,
            "max_position_embeddings": 4096,
            "bos_token_id": 1004,
            "eos_token_id": 1005,
            "fuse_norm": False,
            "fuse_swiglu": False,
            "fuse_cross_entropy": False,
            "use_cache": False,
            "tie_word_embeddings": False,
            **overrides,
        }

    def linear_mixers(self, model: nn.Module) -> list[nn.Module]:
        return [b.attn for b in self.decoder_blocks(model)]

    def _shape(self, cfg: Any) -> tuple[int, int, int, int]:
        g = lambda k, d=None: _flops._get(cfg, k, d)  # noqa: E731
        hk = g("num_heads")
        hv = g("num_v_heads") or hk
        dk = g("head_dim")
        return hk, hv, dk, int(dk * g("expand_v", 2.0))

    def linear_layer_shape(self, config: Any) -> tuple[int, int, int, int]:
        _, hv, dk, dv = self._shape(config)
        return _flops._get(config, "num_hidden_layers"), hv, dk, dv

    def full_attention_layers(self, config: Any) -> int:
        return 0

    def lm_matmul_params(self, config: Any) -> int:
        """Per layer: q/k/v, a/b (decay, write strength), ``A_log``/``dt_bias``, the three short
        convolutions' taps, the gate ``g_proj`` and ``o_norm`` weight, ``o_proj``, a SwiGLU MLP
        and two RMSNorms; then the final norm and the LM head (``_flops`` convention)."""
        cfg = self.text_config(config)
        g = lambda k, d=None: _flops._get(cfg, k, d)  # noqa: E731
        h = g("hidden_size")
        hk, hv, dk, dv = self._shape(cfg)
        kd, vd = hk * dk, hv * dv
        layer = h * (2 * kd + vd) + 2 * h * hv + 2 * hv + vd * h + dv
        if g("use_short_conv", True):
            layer += (2 * kd + vd) * g("conv_size", 4)
        if g("use_gate", True):
            layer += h * vd
        layer += 3 * h * _mlp_width(cfg) + 2 * h
        return g("num_hidden_layers") * layer + h + h * g("vocab_size")
