"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): a Whisper-large-style audio encoder
(two convolutions, 32 pre-LN blocks, stride-2 pooling: 25 tokens per second), a linear projector
and a Qwen2 decoder. The packed forward runs the encoder on varlen clips (no 30 s padding, see
:mod:`lmms_models._audio`) and places the projected features at the host-known ``<|AUDIO|>``
positions; the decoder is upstream's, on the pack's segments.
"""

from __future__ import annotations

from typing import Any

from ..._registry import register_model
from ..._vl import merge_tiny
from ...parts.audio_lm import AudioLMSpec
from ...parts.text import QWEN2_LIGER_PLAN, TINY_TEXT_IDS, tiny_text

__all__ = ["QWEN2_AUDIO_7B", "AudioLMSpec", "Qwen2AudioSpec"]

# Published Qwen2-Audio-7B(-Instruct) config values (random weights are used for benchmarks).
QWEN2_AUDIO_7B: dict[str, Any] = {
    "audio_config": {
        "d_model": 1280,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    },
    "text_config": {
        "model_type": "qwen2",
        "vocab_size": 156032,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "use_cache": False,
    },
    "audio_token_id": 151646,
}

_TINY: dict[str, Any] = {
    "audio_config": {
        "d_model": 32,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    },
    "text_config": tiny_text(
        model_type="qwen2",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **TINY_TEXT_IDS,
    ),
    "audio_token_id": 1006,
}


@register_model("qwen2_audio")
class Qwen2AudioSpec(AudioLMSpec):
    processor_family = "qwen2_audio"
    liger_plan = QWEN2_LIGER_PLAN  # the Whisper-style encoder's LayerNorm and GELU stay upstream
    config_class = "Qwen2AudioConfig"
    model_class = "Qwen2AudioForConditionalGeneration"
    mask_mapping = True  # its Qwen2 decoder: `isinstance(attention_mask, dict)` branch
    presets = {"7b": QWEN2_AUDIO_7B}  # noqa: RUF012

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)
