"""Qwen2.5-Omni thinker (``Qwen2_5OmniThinkerForConditionalGeneration``): the text-generating
part of Qwen2.5-Omni (the talker and the speech decoder are not trained), composed of the Omni
audio part (:mod:`lmms_models.parts.omni_audio`: Whisper-style audio encoder in 2 s chunks,
TMRoPE, the two-tower order; a released full Omni folder is read and written back,
:mod:`lmms_models.parts.omni_checkpoint`) and the Qwen2.5-VL part
(:mod:`lmms_models.parts.qwen2_5_vision`: windowed ViT, Qwen2.5 decoder).
"""

from __future__ import annotations

from typing import Any

from ..._registry import register_model
from ..._vl import merge_tiny
from ...parts.omni_audio import OmniAudioPart, omni_audio_flops
from ...parts.qwen2_5_vision import Qwen2_5VisionPart

__all__ = ["QWEN2_5_OMNI_3B", "QWEN2_5_OMNI_7B", "Qwen2_5OmniSpec", "omni_audio_flops"]

# Qwen2.5-Omni-7B's thinker (random weights: benchmarks and GPU examples). Sources, checked
# 2026-12 (no hub access here): text and audio values as the released config.json, quoted in
# public test fixtures (rtp-llm's Qwen2.5-Omni tests: hidden 3584, 18944, 28 layers, 28/4 heads,
# vocab 152064, rope_theta 1e6, audio 1280 wide, 32 layers, 20 heads, 5120, output 3584; vision
# embed 1280, depth 32, 16 heads); the rest are transformers' Qwen2.5-Omni config defaults,
# documented as Qwen/Qwen2.5-Omni-7B's (audio n_window 100; ViT 3420 wide, window 112, full
# attention at 7/15/23/31, patch 14; mrope_section 16/24/24; token ids 151646-151656; 25
# positions per second, 2 s chunks).
QWEN2_5_OMNI_7B: dict[str, Any] = {
    "audio_config": {
        "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500,
        "n_window": 100, "output_dim": 3584,
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        "in_channels": 3,
    },
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False, "use_cache": False,
    },
    "audio_token_id": 151646, "image_token_id": 151655, "video_token_id": 151656,
    "audio_start_token_id": 151647, "audio_end_token_id": 151648,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "position_id_per_seconds": 25, "seconds_per_chunk": 2,
}  # fmt: skip

# Qwen2.5-Omni-3B's thinker: the same towers projecting to 2048, the Qwen2.5-3B decoder shape
# (vocab 151936, hidden 2048, 11008, 36 layers, 16/2 heads of 128, rope_theta 1e6, 32768
# positions: the released config.json's text values as quoted in public ports, e.g. Tyr's
# Qwen25Omni config). Not verified: whether its thinker ties the LM head (kept untied).
QWEN2_5_OMNI_3B: dict[str, Any] = {
    **QWEN2_5_OMNI_7B,
    "audio_config": {**QWEN2_5_OMNI_7B["audio_config"], "output_dim": 2048},
    "vision_config": {**QWEN2_5_OMNI_7B["vision_config"], "out_hidden_size": 2048},
    "text_config": {
        **QWEN2_5_OMNI_7B["text_config"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2,
    },
}  # fmt: skip

_TINY: dict[str, Any] = {
    "audio_config": {
        "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
        "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100, "output_dim": 64,
    },
    "vision_config": {
        "depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1],
        "in_channels": 3,
    },
    "text_config": {
        "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [4, 2, 2]},
        "tie_word_embeddings": False, "use_cache": False,
    },
    "image_token_id": 1000, "video_token_id": 1001, "vision_start_token_id": 1002,
    "vision_end_token_id": 1003, "audio_token_id": 1006, "audio_start_token_id": 1007,
    "audio_end_token_id": 1008, "position_id_per_seconds": 25, "seconds_per_chunk": 2,
    "tie_word_embeddings": False,
}  # fmt: skip


@register_model("qwen2_5_omni")
class Qwen2_5OmniSpec(OmniAudioPart, Qwen2_5VisionPart):
    processor_family = "qwen2_5_omni"
    #: Liger (lmms_kernels.apply_liger): text decoder and the Qwen2.5-VL-style vision tower's SwiGLU
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen2_5OmniRMSNorm",),
        "mlp": ("Qwen2MLP", "Qwen2_5OmniMLP"),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
    }
    config_class = "Qwen2_5OmniThinkerConfig"
    model_class = "Qwen2_5OmniThinkerForConditionalGeneration"
    folder_model_types = ("qwen2_5_omni_thinker",)  # a thinker-only folder (the export)
    presets = {"3b": QWEN2_5_OMNI_3B, "7b": QWEN2_5_OMNI_7B}  # noqa: RUF012
    host_keys = (*Qwen2_5VisionPart.host_keys, *OmniAudioPart.audio_host_keys)

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)
