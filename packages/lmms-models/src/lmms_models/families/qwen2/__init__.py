"""Qwen2 dense decoder (``Qwen2ForCausalLM``): q/k/v biases, GQA, SwiGLU, RMSNorm (the Qwen2
decoder part, :class:`lmms_models.parts.text.Qwen2DecoderPart`)."""

from __future__ import annotations

from ..._registry import register_model
from ...parts.text import Qwen2DecoderPart, tiny_text

__all__ = ["Qwen2Spec", "tiny_text"]


@register_model("qwen2")
class Qwen2Spec(Qwen2DecoderPart):
    processor_family = "qwen2"
