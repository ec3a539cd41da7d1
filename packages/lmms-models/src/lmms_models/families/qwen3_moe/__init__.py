"""Qwen3-MoE decoder (``Qwen3MoeForCausalLM``): Qwen3 attention, top-k routed SwiGLU experts.

The packed loss is the language-model loss only; the router's auxiliary loss (used upstream when
``output_router_logits=True``) is not added. Expert parallelism comes later (lmms-parallel plans).
"""

from __future__ import annotations

from typing import Any

from ... import _flops
from ..._registry import register_model
from ..._spec import ModelSpec
from ..qwen2 import tiny_text

__all__ = ["Qwen3MoeSpec"]


@register_model("qwen3_moe")
class Qwen3MoeSpec(ModelSpec):
    processor_family = "qwen3"
    config_class = "Qwen3MoeConfig"
    model_class = "Qwen3MoeForCausalLM"

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        moe = dict(
            head_dim=32,
            attention_bias=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
        )
        return tiny_text(**{**moe, **overrides})

    def lm_matmul_params(self, config: Any) -> int:
        cfg = self.text_config(config)
        bias = bool(_flops._get(cfg, "attention_bias", False))
        return _flops.dense_lm_matmul_params(cfg, qk_norm=True, attention_bias=bias)
