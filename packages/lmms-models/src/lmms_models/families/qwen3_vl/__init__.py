"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the Qwen3-VL part
(:mod:`lmms_models.parts.qwen3_vision`: Qwen3 decoder with interleaved mRoPE, a ViT with learned
position embeddings and deepstack at host positions), registered as a family."""

from __future__ import annotations

from ..._registry import register_model
from ...parts.qwen3_vision import (
    DEEPSTACK_KEY,
    DeepstackAtPositions,
    Qwen3VisionPart,
    deepstack_by_index,
)

__all__ = ["DEEPSTACK_KEY", "DeepstackAtPositions", "Qwen3VLSpec", "deepstack_by_index"]


@register_model("qwen3_vl")
class Qwen3VLSpec(Qwen3VisionPart):
    """Qwen3-VL: the part's defaults are this family's."""
