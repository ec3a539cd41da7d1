"""Qwen2 dense decoder (``Qwen2ForCausalLM``): q/k/v biases, GQA, SwiGLU, RMSNorm."""

from __future__ import annotations

from typing import Any

from ..._plans import QWEN2_TP_PLAN, QWEN2_TP_SP_PLAN
from ..._registry import register_model
from ..._spec import ModelSpec

__all__ = ["Qwen2Spec"]


def tiny_text(**overrides: Any) -> dict[str, Any]:
    """Shared tiny decoder shape: 2 layers, 4 heads / 2 KV heads, vocab 1024."""
    cfg: dict[str, Any] = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg.update(overrides)
    return cfg


@register_model("qwen2")
class Qwen2Spec(ModelSpec):
    tp_plan = QWEN2_TP_PLAN
    tp_sp_plan = QWEN2_TP_SP_PLAN
    processor_family = "qwen2"
    liger_plan = {"rms_norm": ("Qwen2RMSNorm",), "mlp": ("Qwen2MLP",)}  # noqa: RUF012
    config_class = "Qwen2Config"
    model_class = "Qwen2ForCausalLM"
    mask_mapping = True  # upstream decoder: `isinstance(attention_mask, dict)` branch

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return tiny_text(**overrides)
