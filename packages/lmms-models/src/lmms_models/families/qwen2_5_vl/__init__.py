"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the Qwen2.5-VL part
(:mod:`lmms_models.parts.qwen2_5_vision`: Qwen2.5 decoder with 3-D mRoPE and the windowed
SwiGLU/RMSNorm ViT), registered as a family."""

from __future__ import annotations

from typing import Any

from ..._registry import register_model
from ..._vl import merge_tiny
from ...parts.qwen2_5_vision import QWEN2_5_VL_3B, QWEN2_5_VL_TINY, Qwen2_5VisionPart

__all__ = ["QWEN2_5_VL_3B", "Qwen2_5_VLSpec"]


@register_model("qwen2_5_vl")
class Qwen2_5_VLSpec(Qwen2_5VisionPart):
    processor_family = "qwen2_5_vl"
    #: Liger (lmms_kernels.apply_liger): text and vision SwiGLU
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen2_5_VLRMSNorm",),
        "mlp": ("Qwen2MLP", "Qwen2_5_VLMLP"),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
    }
    config_class = "Qwen2_5_VLConfig"
    model_class = "Qwen2_5_VLForConditionalGeneration"
    presets = {"3b": QWEN2_5_VL_3B}  # noqa: RUF012

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(QWEN2_5_VL_TINY, overrides)
