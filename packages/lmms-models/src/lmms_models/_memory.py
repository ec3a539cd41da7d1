"""The shapes a memory plan needs from a family: its towers of repeated blocks.

`ModelSpec.memory_towers(config)` returns `{tower name: TowerShape}`; the trainer's planner
(`lmms_train._memory`, `lmms-train plan`) turns them into activation bytes per block. Parameter
counts come from the model built on the meta device, not from here.

What one un-checkpointed pre-norm block keeps for backward, per token, in the compute dtype (bf16),
with the fused kernels the trainer runs (Liger/compiled RMSNorm keeps its input, SwiGLU keeps its
two inputs, varlen attention keeps q, k, v and its output), is counted by
:meth:`TowerShape.saved_bytes_per_token`: the two norms' inputs and outputs (4·H), q, k, v and
the attention output at the width the attention kernel stores them (head dims padded to what it
computes), the output projection's input when that is a separate copy, and the MLP's
intermediates (3·I gated, 2·I plain; top-k routed experts: 3·k·I_expert plus four k·H copies of
the routed tokens). Measured against it (benchmarks/RESULTS.md, "Memory plan"):
Qwen2.5-3B text at 16k, no checkpointing, 93.8 GiB on an H200, 93.3 predicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TowerShape", "decoder_tower"]


@dataclass(frozen=True, slots=True)
class TowerShape:
    """One stack of repeated transformer blocks, as the planner sees it.

    ``tokens_per_media_token``: tokens this tower runs per media placeholder token of the packed
    LM row (``None``: the tower runs every packed token, e.g. the decoder). A Qwen-VL ViT runs
    ``spatial_merge_size²`` patches per image token.
    """

    layers: int
    hidden: int
    intermediate: int  # per expert for routed experts
    heads: int
    kv_heads: int
    head_dim: int
    gated_mlp: bool = True
    experts_per_token: int = 0  # top-k of a routed-experts MLP (0: dense)
    shared_intermediate: int = 0  # an always-on shared expert's width
    num_experts: int = 0
    tokens_per_media_token: float | None = None

    def attention_width(self, padded_head_dim: int | None = None) -> tuple[int, int]:
        """(q width, k/v width) as the attention kernel stores them."""
        d = padded_head_dim or self.head_dim
        return self.heads * d, self.kv_heads * d

    def saved_bytes_per_token(self, padded_head_dim: int | None = None, elem: int = 2) -> float:
        """Bytes one un-checkpointed block keeps for backward per token (see the module doc)."""
        h = self.hidden
        q, kv = self.attention_width(padded_head_dim)
        out_copy = self.heads * self.head_dim if q != self.heads * self.head_dim else 0
        attn = q + 2 * kv + q + out_copy
        if self.experts_per_token:
            k = self.experts_per_token
            # 4 k·H: the routed copies around the grouped GEMMs (sorted input, expert outputs,
            # their unsorted copy and the weighted one); the hand count said 2, the H100 run of
            # 2026-12-05 (Qwen3-MoE 16 layers, 32 experts top-4, 16k) measured 4 (RESULTS.md)
            mlp = k * 3 * self.intermediate + 4 * k * h + 3 * self.shared_intermediate
            mlp += 2 * self.num_experts  # fp32 router logits
        else:
            mlp = (3 if self.gated_mlp else 2) * self.intermediate
        return float(elem * (4 * h + attn + mlp))


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def decoder_tower(text_config: Any) -> TowerShape:
    """The decoder of a transformers text config (Llama/Qwen field names; routed experts from
    ``num_experts_per_tok`` and ``moe_intermediate_size``)."""
    h = int(text_config.hidden_size)
    heads = int(_get(text_config, "num_attention_heads", default=1))
    head_dim = int(_get(text_config, "head_dim", default=h // heads))
    k = int(_get(text_config, "num_experts_per_tok", default=0) or 0)
    experts = int(_get(text_config, "num_experts", "num_local_experts", default=0) or 0)
    routed = k > 0 and experts > 0
    inter = _get(text_config, "moe_intermediate_size") if routed else None
    return TowerShape(
        layers=int(text_config.num_hidden_layers),
        hidden=h,
        intermediate=int(inter or _get(text_config, "intermediate_size", default=4 * h)),
        heads=heads,
        kv_heads=int(_get(text_config, "num_key_value_heads", default=heads)),
        head_dim=head_dim,
        experts_per_token=k if routed else 0,
        shared_intermediate=int(_get(text_config, "shared_expert_intermediate_size", default=0))
        if routed
        else 0,
        num_experts=experts if routed else 0,
    )
