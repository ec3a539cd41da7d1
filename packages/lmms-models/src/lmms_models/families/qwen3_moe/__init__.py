"""Qwen3-MoE decoder (``Qwen3MoeForCausalLM``): Qwen3 attention, top-k routed SwiGLU experts.

Router auxiliary (load-balancing) loss: with ``config.output_router_logits=True`` the packed
forward asks the base model for its router logits (``output_router_logits=True``, as upstream's
``Qwen3MoeForCausalLM.forward`` does) and adds upstream's own ``load_balancing_loss_func`` on the
row's real tokens (the tail padding segment is masked out) as

    loss_sum + router_aux_loss_coef · aux · n_loss_tokens

so that, once the trainer divides by the token count, one micro-batch gives exactly upstream's
``loss + coef · aux`` and several give the token-weighted mean of their aux terms (each pack's
aux is taken over that pack's tokens, like upstream's over its batch). With Ulysses SP each rank
takes aux over its own slice of the row (its router logits), weighted by its local loss-token
count; after ``sp_reduce_loss`` that is the token-weighted mean of the per-slice aux terms (the
same rule as for micro-batches, not the aux of the whole row). With ``output_router_logits=False``
(the default) the loss is the language-model loss only.

Masks: the decoder (transformers 5.17 to 5.24) has no ``{layer type: mask}`` branch, so
``mask_mapping`` cannot skip its mask preparation, which from ``position_ids`` alone looks for
packed sequences and reads the answer on the host (one synchronisation per forward, for a mask
varlen attention ignores). :meth:`Qwen3MoeSpec.media_context` hands it an empty 4-D mask instead,
which upstream takes as prepared and returns as-is (:data:`PREPARED_MASK_SHAPE`).

Router aux loss, fast experts (``set_experts``), the expert-parallel plan and the expert-load
meter are shared with the other MoE families (:mod:`lmms_models._moe`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from ... import _flops
from ..._moe import MoESpecMixin
from ..._registry import register_model
from ..._spec import ModelSpec
from ...parts.text import PREPARED_MASK_SHAPE, prepared_empty_mask, tiny_text

__all__ = ["PREPARED_MASK_SHAPE", "Qwen3MoeSpec", "prepared_empty_mask"]


@register_model("qwen3_moe")
class Qwen3MoeSpec(MoESpecMixin, ModelSpec):
    """Router aux loss, experts implementation and EP plan: :class:`lmms_models.MoESpecMixin`."""

    processor_family = "qwen3"
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3MoeRMSNorm",),
        "mlp": ("Qwen3MoeMLP",),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
        "mlp_optional": True,
    }
    aux_loss_module = "qwen3_moe"
    config_class = "Qwen3MoeConfig"
    model_class = "Qwen3MoeForCausalLM"
    # No ``mask_mapping`` (see the module docstring): :func:`prepared_empty_mask` instead.

    def media_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The packed forward's context: :func:`prepared_empty_mask` on the text decoder."""
        return prepared_empty_mask(self.text_model(model))

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
