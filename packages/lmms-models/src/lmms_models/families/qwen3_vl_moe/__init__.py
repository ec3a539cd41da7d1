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
from ...parts.qwen3_vision import QWEN3_VL_TINY as _QWEN3_VL_TINY
from ...parts.qwen3_vision import Qwen3VisionPart

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

#: Qwen3-VL-30B-A3B's shape (random weights: benchmarks and GPU examples). 48 decoder layers of
#: 128 experts (8 active, 768 wide), hidden 2048, 32 heads / 4 KV heads of 128; the 27-layer
#: ViT of Qwen3-VL with deepstack at layers 8, 16, 24. 31.1B parameters; 3.0B LM matmul parameters
#: active per token (lm_matmul_params).
QWEN3_VL_30B_A3B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": True,
        "router_aux_loss_coef": 0.001,
        "use_cache": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
        "in_channels": 3,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}


@register_model("qwen3_vl_moe")
class Qwen3VLMoeSpec(MoESpecMixin, Qwen3VisionPart):
    processor_family = "qwen3_vl"
    #: Liger (lmms_kernels.apply_liger): dense MLPs only where a layer is dense (often none)
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3VLMoeTextRMSNorm",),
        "mlp": ("Qwen3VLMoeTextMLP",),
        "mlp_optional": True,
    }
    config_class = "Qwen3VLMoeConfig"
    model_class = "Qwen3VLMoeForConditionalGeneration"
    aux_loss_module = "qwen3_vl_moe"
    presets = {"30b_a3b": QWEN3_VL_30B_A3B}  # noqa: RUF012

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)
