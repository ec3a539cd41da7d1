"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): the Qwen3-VL vision tower and deepstack
over a Qwen3-MoE text decoder (top-k routed SwiGLU experts stored as 3-D tensors).

Everything visual (host-precomputed tower inputs, media merged at host positions, deepstack by
index) is :class:`~lmms_models.parts.qwen3_vision.Qwen3VisionPart`'s; everything sparse (router
load-balancing loss in the packed forward, experts on grouped GEMMs through transformers'
experts registry, the expert-parallel plan, the expert-load meter) is
:class:`lmms_models.MoESpecMixin`'s. The processor is Qwen3-VL's.
"""

from __future__ import annotations

from typing import Any

from ..._moe import MoESpecMixin
from ..._registry import register_model
from ..._vl import merge_tiny
from ...parts.qwen3_vision import QWEN3_VL_30B_A3B, Qwen3VisionPart
from ...parts.qwen3_vision import QWEN3_VL_TINY as _QWEN3_VL_TINY

__all__ = ["QWEN3_VL_30B_A3B", "Qwen3VLMoeSpec"]

_TINY: dict[str, Any] = merge_tiny(
    _QWEN3_VL_TINY,
    {
        "text_config": {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    },
)


@register_model("qwen3_vl_moe")
class Qwen3VLMoeSpec(MoESpecMixin, Qwen3VisionPart):
    processor_family = "qwen3_vl"
    #: Liger (lmms_kernels.apply_liger): dense MLPs only where a layer is dense (often none)
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3VLMoeTextRMSNorm",),
        "mlp": ("Qwen3VLMoeTextMLP",),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
        "mlp_optional": True,
    }
    config_class = "Qwen3VLMoeConfig"
    model_class = "Qwen3VLMoeForConditionalGeneration"
    aux_loss_module = "qwen3_vl_moe"
    presets = {"30b_a3b": QWEN3_VL_30B_A3B}  # noqa: RUF012

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)
