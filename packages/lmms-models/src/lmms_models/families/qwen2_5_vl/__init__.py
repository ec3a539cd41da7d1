"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the Qwen2.5-VL part
(:mod:`lmms_models.parts.qwen2_5_vision`: Qwen2.5 decoder with 3-D mRoPE and the windowed
SwiGLU/RMSNorm ViT), registered as a family."""

from __future__ import annotations

from ..._registry import register_model
from ...parts.qwen2_5_vision import QWEN2_5_VL_3B, Qwen2_5VisionPart

__all__ = ["QWEN2_5_VL_3B", "Qwen2_5_VLSpec"]


@register_model("qwen2_5_vl")
class Qwen2_5_VLSpec(Qwen2_5VisionPart):
    """Qwen2.5-VL: the part's defaults are this family's."""
