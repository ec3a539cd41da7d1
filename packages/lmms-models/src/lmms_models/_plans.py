"""Tensor-parallel plans of the Qwen decoders, as data for :func:`lmms_parallel.apply_tp`.

Patterns are relative to the text decoder (``spec.plan_root(model)``); styles are lmms-parallel's
(``colwise``/``rowwise``: Megatron's attention and SwiGLU pairs; ``sum_grad``: Qwen3's per-head
q/k norms, which see only the local heads). Norms, embeddings and the LM head stay replicated on
the TP group (FSDP2 shards them over the data-parallel ranks), so the fused loss runs on the
whole hidden state and never gathers ``[T, vocab]``. The expert-parallel plan of the MoE
families is :data:`lmms_models.EXPERTS_EP_PLAN`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["QWEN2_TP_PLAN", "QWEN3_TP_PLAN", "check_tp_heads"]

#: Qwen2 / Qwen2.5 (and Qwen2.5-VL's text decoder): q/k/v with biases (sharded with the rows).
QWEN2_TP_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

#: Qwen3 / Qwen3-VL's text decoder: Qwen2's plan plus the per-head q/k RMSNorms.
QWEN3_TP_PLAN: dict[str, str] = {
    **QWEN2_TP_PLAN,
    "layers.*.self_attn.q_norm": "sum_grad",
    "layers.*.self_attn.k_norm": "sum_grad",
}


def check_tp_heads(text_config: Any, tp: int) -> None:
    """Raise unless ``tp`` divides the attention and KV heads (each rank takes whole heads)."""
    heads = text_config.num_attention_heads
    kv = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % tp or kv % tp:
        raise ValueError(
            f"tp_degree {tp} must divide the attention heads ({heads}) and the KV heads ({kv}): "
            "each tensor-parallel rank takes whole heads"
        )
