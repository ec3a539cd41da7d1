"""Qwen3.5 (``Qwen3_5ForConditionalGeneration``): the Qwen3.5 part
(:mod:`lmms_models.parts.qwen3_5_hybrid`: Gated DeltaNet + gated softmax decoder, packed mixer)
with the Qwen3-VL-style vision tower (:mod:`lmms_models.parts.qwen3_vision`), registered with the
released 2B shape."""

from __future__ import annotations

from typing import Any

from ..._registry import register_model
from ...parts.qwen3_5_hybrid import (
    QWEN3_5_TEXT_COMMON,
    QWEN3_5_VISION_COMMON,
    HybridQwenMixin,
    hybrid_lm_matmul_params,
    no_mask_preparation,
    tiny_qwen3_5,
)
from ...parts.qwen3_vision import Qwen3VisionPart

__all__ = [
    "QWEN3_5_2B",
    "QWEN3_5_TEXT_COMMON",
    "QWEN3_5_VISION_COMMON",
    "Qwen3_5Spec",
    "hybrid_lm_matmul_params",
    "no_mask_preparation",
    "tiny_qwen3_5",
]


#: Qwen3.5-2B's shape (random weights; benchmarks and GPU examples), as its published config.json
#: gives it (Qwen/Qwen3.5-2B; the values read from public copies of that file, no download): 24
#: decoder layers, three Gated DeltaNet layers (16 key / 16 value heads) to one gated softmax
#: layer (8 heads, 2 KV heads), width 2048, SwiGLU 6144, tied embeddings; the vision tower of the
#: 2B and 4B checkpoints (24 layers of width 1024, MLP 4096) merged into 2048. ~1.9B parameters
#: in the decoder with its embedding.
QWEN3_5_2B: dict[str, Any] = {
    "text_config": {
        **QWEN3_5_TEXT_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
    },
    "vision_config": {
        **QWEN3_5_VISION_COMMON,
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "out_hidden_size": 2048,
    },
    "tie_word_embeddings": True,
}


@register_model("qwen3_5")
class Qwen3_5Spec(HybridQwenMixin, Qwen3VisionPart):
    engine_dataset_types = ("qwen3_5_iterable",)  # lmms-engine's Qwen3.5 records
    processor_family = "qwen3_vl"  # the released checkpoints ship Qwen3-VL's processor
    #: Liger (lmms_kernels.apply_liger): zero-centred RMSNorm weight, x * (1 + w) in fp32 (the Gated
    #: DeltaNet mixer's gated norm and the vision tower's GELU MLP stay upstream)
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3_5RMSNorm",),
        "mlp": ("Qwen3_5MLP",),
        "rms_offset": 1.0,
        "rms_casting": "gemma",
    }
    config_class = "Qwen3_5Config"
    model_class = "Qwen3_5ForConditionalGeneration"
    presets = {"2b": QWEN3_5_2B}  # noqa: RUF012 (read-only class table)

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return tiny_qwen3_5(**overrides)

    def lm_matmul_params(self, config: Any) -> int:
        return hybrid_lm_matmul_params(self.text_config(config))
