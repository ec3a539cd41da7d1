"""The Qwen3.5 part (``Qwen3_5ForConditionalGeneration``'s layout): a hybrid decoder of Gated DeltaNet
(linear-attention) layers and gated softmax-attention layers (three to one in the released
models), interleaved mRoPE, and a Qwen3-VL-style vision tower (learned, interpolated position
embeddings; no deepstack) for images and video.

Packing: the softmax layers take lmms varlen attention through transformers' attention registry
like every family; the linear layers get lmms' packed mixer
(:func:`lmms_models._linear_attention.qwen3_5_packed_mixer`): the short convolution and the
delta-rule recurrence restart at every sample (upstream's convolution would read across sample
boundaries). The decoder gets its layer masks as a prepared ``{layer type: None}`` mapping, which
skips transformers' mask preparation (and its host read of the positions) for masks lmms never
uses (:func:`no_mask_preparation`).

:class:`HybridQwenMixin` with :class:`~lmms_models.parts.qwen3_vision.Qwen3VisionPart` is what the
``qwen3_5`` and ``qwen3_5_moe`` families compose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .. import _flops
from .._attention import forward_pre_hook
from .._linear_attention import qwen3_5_packed_mixer, upstream_mixer_on_torch
from .._linear_spec import LinearAttentionMixin
from .._vl import TINY_TOKEN_IDS, QwenVLSpec, merge_tiny, tiny_qwen_vision
from .qwen3_vision import Qwen3VisionPart
from .text import TINY_TEXT_IDS, tiny_text

__all__ = [
    "QWEN3_5_TEXT_COMMON",
    "QWEN3_5_VISION_COMMON",
    "HybridQwenMixin",
    "hybrid_lm_matmul_params",
    "no_mask_preparation",
    "tiny_qwen3_5",
]

_TINY_TEXT: dict[str, Any] = tiny_text(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    **TINY_TEXT_IDS,
)

_TINY_VISION: dict[str, Any] = tiny_qwen_vision(depth=2, num_position_embeddings=16)


def tiny_qwen3_5(text: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """The tiny Qwen3.5(-MoE) config: ``text`` entries added to the text config."""
    base = {
        "text_config": {**_TINY_TEXT, **(text or {})},
        "vision_config": dict(_TINY_VISION),
        **TINY_TOKEN_IDS,
        "tie_word_embeddings": False,
    }
    return merge_tiny(base, overrides)


@contextlib.contextmanager
def no_mask_preparation(text_model: nn.Module) -> Iterator[None]:
    """While active, a call of the hybrid text model without ``attention_mask`` gets
    ``{"full_attention": None, "linear_attention": None}``: upstream takes a mapping as prepared
    masks (varlen attention and the packed mixers take the segments from ``cu_seqlens``)."""

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("attention_mask") is not None:
            return args, kwargs
        masks = {"full_attention": None, "linear_attention": None}
        return args, {**kwargs, "attention_mask": masks}

    with forward_pre_hook(text_model, hook):
        yield


def hybrid_lm_matmul_params(cfg: Any, *, mlp: int | None = None) -> int:
    """Matmul parameters per token of a Qwen3.5(-MoE) decoder (``_flops`` convention).

    Softmax layers: ``q_proj`` twice as wide (query and output gate), k/v/o, q/k norms. Linear
    layers: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, the depthwise conv
    taps, ``A_log``/``dt_bias``, the gated norm, ``out_proj``. ``mlp``: active MLP parameters
    of one layer (default: the dense SwiGLU ``3·h·I``). Two RMSNorms per layer, the final norm and
    the LM head.
    """
    g = lambda k, d=None: _flops._get(cfg, k, d)  # noqa: E731
    h, nh, nkv, d = (
        g("hidden_size"),
        g("num_attention_heads"),
        g("num_key_value_heads"),
        _flops.head_dim(cfg),
    )
    bias = bool(g("attention_bias", False))
    full = h * nh * d * 2 + 2 * h * nkv * d + nh * d * h + 2 * d
    if bias:
        full += nh * d * 2 + 2 * nkv * d + h
    hk, hv = g("linear_num_key_heads"), g("linear_num_value_heads")
    kd, vd = hk * g("linear_key_head_dim"), hv * g("linear_value_head_dim")
    conv = 2 * kd + vd
    linear = h * conv + h * vd + 2 * h * hv + conv * g("linear_conv_kernel_dim") + 2 * hv
    linear += g("linear_value_head_dim") + vd * h
    mlp = 3 * h * g("intermediate_size") if mlp is None else mlp
    total = 0
    for kind in g("layer_types"):
        total += (linear if kind == "linear_attention" else full) + mlp + 2 * h
    return total + h + h * g("vocab_size")


class HybridQwenMixin(LinearAttentionMixin):
    """The Qwen3.5 hybrid decoder's hooks, shared by the dense and MoE families."""

    packed_mixer = staticmethod(qwen3_5_packed_mixer)
    upstream_mixer = staticmethod(upstream_mixer_on_torch)

    def linear_mixers(self, model: nn.Module) -> list[nn.Module]:
        return [b.linear_attn for b in self.decoder_blocks(model) if hasattr(b, "linear_attn")]  # type: ignore[attr-defined]

    def linear_layer_shape(self, config: Any) -> tuple[int, int, int, int]:
        g = lambda k: _flops._get(config, k)  # noqa: E731
        n = sum(1 for t in g("layer_types") if t == "linear_attention")
        return n, g("linear_num_value_heads"), g("linear_key_head_dim"), g("linear_value_head_dim")

    def full_attention_layers(self, config: Any) -> int:
        return sum(1 for t in _flops._get(config, "layer_types") if t == "full_attention")

    @contextlib.contextmanager
    def media_context(self, model: nn.Module) -> Iterator[None]:
        """The vision tower's host inputs (:class:`QwenVLSpec`) and :func:`no_mask_preparation`
        on the text model (no deepstack: Qwen3-VL's hooks are left out)."""
        with QwenVLSpec.media_context(self, model), no_mask_preparation(self.text_model(model)):  # type: ignore[arg-type, attr-defined]
            yield

    def media_extras(self, model: nn.Module, placed: Any, embeds: Any) -> dict[str, Any]:
        return {}  # no deepstack

    def vision_matmul_params(self, config: Any) -> dict[str, int]:
        """Qwen3-VL's count without deepstack mergers."""
        v = _flops._get(config, "vision_config", config)
        vd = v.to_dict() if hasattr(v, "to_dict") else dict(v)
        return Qwen3VisionPart.vision_matmul_params(
            self,  # type: ignore[arg-type]
            {"vision_config": {**vd, "deepstack_visual_indexes": []}},
        )


#: What every released Qwen3.5(-MoE) config shares (text): the 248k vocabulary, softmax heads of
#: 256, linear heads of 128 with 4-tap convolutions, interleaved mRoPE over a quarter of each head
#: (theta 1e7), 262k positions; and the vision tower's patching (16 px, 2x2 merge, 2 frames).
QWEN3_5_TEXT_COMMON: dict[str, Any] = {
    "vocab_size": 248320,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "use_cache": False,
}
QWEN3_5_VISION_COMMON: dict[str, Any] = {
    "num_heads": 16,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
}
