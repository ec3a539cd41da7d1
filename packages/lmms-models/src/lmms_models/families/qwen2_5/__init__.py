"""Qwen2.5 dense decoder: the Qwen2 decoder part (``Qwen2ForCausalLM``) with its own presets."""

from __future__ import annotations

from ..._registry import register_model
from ...parts.text import Qwen2DecoderPart

__all__ = ["Qwen2_5Spec"]

# Published Qwen2.5-3B shape (random weights are used for benchmarks).
QWEN2_5_3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
    hidden_act="silu",
    use_cache=False,
)

# Published Qwen2.5-1.5B shape.
QWEN2_5_1_5B = {
    **QWEN2_5_3B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}


@register_model("qwen2_5")
class Qwen2_5Spec(Qwen2DecoderPart):
    processor_family = "qwen2_5"
    presets = {"1.5b": QWEN2_5_1_5B, "3b": QWEN2_5_3B}  # noqa: RUF012
