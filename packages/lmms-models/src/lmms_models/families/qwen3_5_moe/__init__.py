"""Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``): Qwen3.5's hybrid Gated DeltaNet /
softmax-attention decoder with a sparse MLP in every layer (top-k routed experts stored as 3-D
tensors, plus a sigmoid-gated shared expert) and the same vision tower.

Everything hybrid (packed mixers, mask mapping, FLOPs of the linear layers) is
:class:`~lmms_models.families.qwen3_5.HybridQwenMixin`'s; everything sparse (router
load-balancing loss in the packed forward, grouped-GEMM experts through transformers' experts
registry, the expert-parallel plan ``{"layers.*.mlp.experts": "experts"}``, the expert-load
meter) is :class:`lmms_models.MoESpecMixin`'s. The processor is Qwen3-VL's.
"""

from __future__ import annotations

from typing import Any

from ... import _flops
from ..._moe import MoESpecMixin
from ..._registry import register_model
from ..qwen3_5 import HybridQwenMixin, hybrid_lm_matmul_params, tiny_qwen3_5
from ..qwen3_vl import Qwen3VLSpec

__all__ = ["Qwen3_5MoeSpec"]

_TINY_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


@register_model("qwen3_5_moe")
class Qwen3_5MoeSpec(MoESpecMixin, HybridQwenMixin, Qwen3VLSpec):
    processor_family = "qwen3_vl"
    aux_loss_module = "qwen3_5_moe"
    config_class = "Qwen3_5MoeConfig"
    model_class = "Qwen3_5MoeForConditionalGeneration"

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return tiny_qwen3_5(_TINY_MOE, **overrides)

    def lm_matmul_params(self, config: Any) -> int:
        """The hybrid count with, per layer, the ``top_k`` active experts, the router, the shared
        expert and its gate as the MLP."""
        cfg = self.text_config(config)
        g = lambda k: _flops._get(cfg, k)  # noqa: E731
        h = g("hidden_size")
        mlp = g("num_experts_per_tok") * 3 * h * g("moe_intermediate_size") + h * g("num_experts")
        mlp += 3 * h * g("shared_expert_intermediate_size") + h
        return hybrid_lm_matmul_params(cfg, mlp=mlp)
