"""Tensor-parallel plans of the Qwen decoders, as data for :func:`lmms_parallel.apply_tp`.

Patterns are relative to the text decoder (``spec.plan_root(model)``); styles are lmms-parallel's
(``colwise``/``rowwise``: Megatron's attention and SwiGLU pairs; ``sum_grad``: Qwen3's per-head
q/k norms, which see only the local heads). Norms and embeddings stay replicated on the TP group
(FSDP2 shards them over the data-parallel ranks); the LM head is split over the vocabulary
(:data:`LM_HEAD_TP_PLAN`) and the loss is the vocab-parallel cross-entropy
(:func:`head_cross_entropy`), so ``[T, vocab]`` is never gathered. The expert-parallel plan of
the MoE families is :data:`lmms_models.EXPERTS_EP_PLAN`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "LM_HEAD_TP_PLAN",
    "QWEN2_TP_PLAN",
    "QWEN2_TP_SP_PLAN",
    "QWEN3_TP_PLAN",
    "QWEN3_TP_SP_PLAN",
    "QWEN3_VL_TP_SP_PLAN",
    "check_tp_heads",
    "head_cross_entropy",
]

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


def _sp(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with sequence parallelism inside TP (Megatron SP, lmms_parallel._tp_sp): the
    residual stream split over the sequence between sub-blocks, the norms on local tokens."""
    return {
        **plan,
        "layers.*.self_attn.o_proj": "rowwise_sp",
        "layers.*.mlp.down_proj": "rowwise_sp",
        "layers.*.self_attn": "sp_gather_input",
        "layers.*.mlp": "sp_gather_input",
        "layers.*.input_layernorm": "sum_grad",
        "layers.*.post_attention_layernorm": "sum_grad",
        "layers.0": "sp_scatter_input",
        "norm": "sp_gather_output",  # the loss sees the whole sequence
    }


#: ``trainer_args.tp_sequence_parallel``: the plans above with sequence-parallel norms.
QWEN2_TP_SP_PLAN: dict[str, str] = _sp(QWEN2_TP_PLAN)
QWEN3_TP_SP_PLAN: dict[str, str] = _sp(QWEN3_TP_PLAN)
#: Qwen3-VL's text decoder adds deepstack features at the visual positions of the whole row after
#: its first layers, where the residual stream is already split: ``sp_deepstack`` on the decoder
#: itself (``""``) adds on each rank only the positions inside its rows (lmms_parallel._tp_sp).
QWEN3_VL_TP_SP_PLAN: dict[str, str] = {**QWEN3_TP_SP_PLAN, "": "sp_deepstack"}


def check_tp_heads(text_config: Any, tp: int) -> None:
    """Raise unless ``tp`` divides the attention and KV heads (each rank takes whole heads)."""
    heads = text_config.num_attention_heads
    kv = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % tp or kv % tp:
        raise ValueError(
            f"tp_degree {tp} must divide the attention heads ({heads}) and the KV heads ({kv}): "
            "each tensor-parallel rank takes whole heads"
        )


#: The LM head under TP (relative to the whole model): rows split over the vocabulary, so the
#: loss never gathers ``[T, vocab]`` (lmms_parallel's ``vocab_parallel`` style). Not applied to
#: a head tied to the input embeddings (the embedding would be split too): that head stays
#: replicated and the ordinary fused loss runs on it.
LM_HEAD_TP_PLAN: dict[str, str] = {"lm_head": "vocab_parallel"}


def head_cross_entropy(
    hidden: torch.Tensor,  # [T, H]
    head: nn.Module,
    labels: torch.Tensor,  # [T] shifted labels
    *,
    backend: str = "auto",
    rows: torch.Tensor | None = None,  # [T_l] int64: the labelled rows (optional)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n)`` of next-token cross-entropy through the LM head ``head``: the fused
    linear cross-entropy of lmms-kernels, or, for a vocabulary-parallel head (TP), lmms-parallel's
    vocab-parallel cross-entropy on this rank's vocabulary rows (same values; ``backend`` does
    not apply there). ``rows``: as ``fused_linear_cross_entropy``'s."""
    from lmms_parallel import vocab_parallel_shard

    shard = vocab_parallel_shard(head.weight)
    if shard is None:
        from lmms_kernels import fused_linear_cross_entropy

        return fused_linear_cross_entropy(
            hidden, head.weight, labels, bias=head.bias, backend=backend, rows=rows
        )
    from lmms_parallel import vocab_parallel_cross_entropy

    weight, group, start = shard
    if rows is not None:  # the same rows on every TP rank (they read the same pack)
        hidden, labels = hidden.index_select(0, rows), labels.reshape(-1)[rows]
    bias = head.bias.to_local() if head.bias is not None else None
    return vocab_parallel_cross_entropy(hidden, weight, labels, group=group, start=start, bias=bias)
