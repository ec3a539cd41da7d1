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
from ...parts.qwen3_5_hybrid import (
    QWEN3_5_TEXT_COMMON,
    QWEN3_5_VISION_COMMON,
    HybridQwenMixin,
    hybrid_lm_matmul_params,
    tiny_qwen3_5,
)
from ...parts.qwen3_vision import Qwen3VisionPart

__all__ = ["QWEN3_5_35B_A3B", "Qwen3_5MoeSpec"]

_TINY_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


#: Qwen3.5-35B-A3B's shape (random weights; benchmarks and GPU examples), as its published
#: config.json gives it (Qwen/Qwen3.5-35B-A3B; the values read from public copies of that file
#: and transformers' ``Qwen3_5MoeTextConfig`` defaults, which document that checkpoint): 40
#: decoder layers, three Gated DeltaNet layers (16 key / 32 value heads of 128) to one gated
#: softmax layer (16 heads of 256, 2 KV heads), width 2048; every layer a sparse MLP of 256
#: experts (8 routed per token, 512 wide) plus a gated shared expert (512); untied embeddings;
#: the 27-layer vision tower (width 1152, MLP 4304) merged into 2048. ~35B parameters, ~3B
#: active per token (``lm_matmul_params``).
QWEN3_5_35B_A3B: dict[str, Any] = {
    "text_config": {
        **QWEN3_5_TEXT_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.001,
    },
    "vision_config": {
        **QWEN3_5_VISION_COMMON,
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "out_hidden_size": 2048,
    },
    "tie_word_embeddings": False,
}


@register_model("qwen3_5_moe")
class Qwen3_5MoeSpec(MoESpecMixin, HybridQwenMixin, Qwen3VisionPart):
    processor_family = "qwen3_vl"
    #: Liger (lmms_kernels.apply_liger): as qwen3_5's; dense MLPs: the shared experts
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3_5MoeRMSNorm",),
        "mlp": ("Qwen3_5MoeMLP",),
        "rms_offset": 1.0,
        "rms_casting": "gemma",
        "mlp_optional": True,
    }
    aux_loss_module = "qwen3_5_moe"
    config_class = "Qwen3_5MoeConfig"
    model_class = "Qwen3_5MoeForConditionalGeneration"
    presets = {"35b_a3b": QWEN3_5_35B_A3B}  # noqa: RUF012 (read-only class table)

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
