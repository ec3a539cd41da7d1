"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the Qwen3-VL part
(:mod:`lmms_models.parts.qwen3_vision`: Qwen3 decoder with interleaved mRoPE, a ViT with learned
position embeddings and deepstack at host positions), registered as a family."""

from __future__ import annotations

from typing import Any

from ..._registry import register_model
from ..._vl import merge_tiny
from ...parts.qwen3_vision import (
    DEEPSTACK_KEY,
    QWEN3_VL_TINY,
    DeepstackAtPositions,
    Qwen3VisionPart,
    deepstack_by_index,
)

__all__ = ["DEEPSTACK_KEY", "DeepstackAtPositions", "Qwen3VLSpec", "deepstack_by_index"]


@register_model("qwen3_vl")
class Qwen3VLSpec(Qwen3VisionPart):
    engine_dataset_types = ("qwen3_vl_iterable",)  # lmms-engine's Qwen3-VL records
    processor_family = "qwen3_vl"
    #: Liger (lmms_kernels.apply_liger): the vision tower's LayerNorm and GELU MLP stay upstream
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3VLTextRMSNorm",),
        "mlp": ("Qwen3VLTextMLP",),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
    }
    config_class = "Qwen3VLConfig"
    model_class = "Qwen3VLForConditionalGeneration"

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(QWEN3_VL_TINY, overrides)
