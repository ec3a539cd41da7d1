"""Aero-1-Audio (``aero``): Qwen2-Audio's encoder + a linear projector + a Qwen2.5 decoder, the
model written once in :mod:`._model` with the public checkpoint's parameter names. The packed
forward is Qwen2-Audio's (:class:`AudioLMSpec`): the encoder on varlen clips without 30 s
padding, features at host-known ``<|AUDIO|>`` positions; the decoder is transformers' Qwen2.
Data: the ``qwen2_audio`` processor (Whisper log-mel, the same placeholder rule).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..._build import build_hf_style
from ..._registry import register_model
from ..._vl import merge_tiny
from ...parts.audio_lm import AudioLMSpec
from ...parts.text import QWEN2_LIGER_PLAN
from ._model import AeroConfig, AeroForConditionalGeneration

__all__ = ["AERO_1_5B", "AeroConfig", "AeroForConditionalGeneration", "AeroSpec"]

# Aero-1-Audio (1.5B): the Qwen2-Audio encoder (Whisper-large shape) and the Qwen2.5-1.5B decoder.
# Sources, checked 2026-12 (no hub access here): the release's own config class
# (EvolvingLMMs-Lab/lmms-engine, models/aero/configuration_aero.py: audio encoder 1280 wide,
# 32 layers, 20 heads, 5120, 128 mel bins, 1500 positions; text config Qwen2.5-1.5B-Instruct's:
# vocab 151936, hidden 1536, 8960, 28 layers, 12/2 heads, rope_theta 1e6, 32768 positions, tied
# embeddings; audio_token_index 151648, its default). A real checkpoint's config.json wins.
AERO_1_5B: dict[str, Any] = {
    "audio_config": {
        "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500,
    },
    "text_config": {
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True, "use_cache": False,
    },
    "audio_token_index": 151648,
}  # fmt: skip

_TINY: dict[str, Any] = {
    "audio_config": {
        "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
        "num_mel_bins": 128, "max_source_positions": 1500,
    },
    "text_config": {
        "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False, "use_cache": False,
    },
    "audio_token_index": 1006,
}  # fmt: skip


@register_model("aero")
class AeroSpec(AudioLMSpec):
    processor_family = "qwen2_audio"
    liger_plan = QWEN2_LIGER_PLAN  # the Whisper-style encoder's LayerNorm and GELU stay upstream
    mask_mapping = True  # its Qwen2 decoder: `isinstance(attention_mask, dict)` branch
    presets = {"1.5b": AERO_1_5B}  # noqa: RUF012
    reference_audio_keys = ("audio_values", "audio_attention_mask")

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        renamed = {  # audio_token_id: the trainer's name for it
            ("audio_token_index" if k == "audio_token_id" else k): v for k, v in overrides.items()
        }
        return merge_tiny(copy.deepcopy(_TINY), renamed)

    def make_config(self, config: dict[str, Any]) -> AeroConfig:
        cfg = dict(config)
        if cfg.pop("model_type", "aero") != "aero":
            raise ValueError(f"config says model_type={config['model_type']!r}, not 'aero'")
        if "audio_token_id" in cfg:
            cfg["audio_token_index"] = cfg.pop("audio_token_id")
        return AeroConfig(**cfg)

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """From a config dict, or a local Aero-1-Audio folder (``config.json`` + safetensors in
        the public layout) through ``from_pretrained``; on meta only the config is read."""
        return build_hf_style(
            self.make_config, AeroForConditionalGeneration, AeroConfig, source, device, dtype,
            sdpa_configs=("audio_config", "text_config"),
        )  # fmt: skip

    # the public layout: no `model.model`
    def base_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def audio_tower(self, model: nn.Module) -> nn.Module:
        return model.audio_tower

    def projector(self, model: nn.Module) -> nn.Module:
        return model.audio_modal_projector

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.language_model.lm_head

    def merge_media(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """As Qwen2-Audio's, and a pack without audio still reaches the decoder as embeddings
        (the decoder is called directly: lmms_parallel's participation hook needs them)."""
        out = super().merge_media(model, inputs)
        if "inputs_embeds" not in out:
            out["inputs_embeds"] = self.base_model(model).get_input_embeddings()(
                out.pop("input_ids")
            )
        return out
