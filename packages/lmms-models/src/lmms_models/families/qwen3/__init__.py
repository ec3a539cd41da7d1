"""Qwen3 dense decoder (``Qwen3ForCausalLM``): no q/k/v biases, per-head q/k RMSNorm, explicit
``head_dim``."""

from __future__ import annotations

from typing import Any

from ... import _flops
from ..._plans import QWEN3_TP_PLAN, QWEN3_TP_SP_PLAN
from ..._registry import register_model
from ..._spec import ModelSpec
from ...parts.text import tiny_text

__all__ = ["Qwen3Spec"]


@register_model("qwen3")
class Qwen3Spec(ModelSpec):
    tp_plan = QWEN3_TP_PLAN
    tp_sp_plan = QWEN3_TP_SP_PLAN
    processor_family = "qwen3"
    engine_model_types = {"qwen3_dllm": "masked_diffusion"}  # noqa: RUF012 (lmms-engine dLLM)
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3RMSNorm",),
        "mlp": ("Qwen3MLP",),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
    }
    config_class = "Qwen3Config"
    model_class = "Qwen3ForCausalLM"
    mask_mapping = True  # upstream decoder: `isinstance(attention_mask, dict)` branch

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return tiny_text(**{"head_dim": 32, "attention_bias": False, **overrides})

    def lm_matmul_params(self, config: Any) -> int:
        cfg = self.text_config(config)
        bias = bool(_flops._get(cfg, "attention_bias", False))
        return _flops.dense_lm_matmul_params(cfg, qk_norm=True, attention_bias=bias)
