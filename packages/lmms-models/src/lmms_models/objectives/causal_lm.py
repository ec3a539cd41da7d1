"""``causal_lm``: next-token cross-entropy, the default objective (today's loss path).

The model spec's :meth:`~lmms_models.ModelSpec.packed_forward` already computes it: causal
varlen attention inside each packed sample, the labels shifted within each sample, a fused linear
cross-entropy that never builds ``[T, vocab]`` logits, and the sums reduced over the SP group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ._base import Objective, ObjectiveContext, ObjectiveOutput, register_objective

__all__ = ["CausalLM"]


@register_objective("causal_lm")
class CausalLM(Objective):
    """Next-token prediction; normalised per supervised token of the global batch."""

    labelled_rows = True
    vocab_parallel_head = True

    def loss(
        self, spec: Any, model: nn.Module, batch: dict[str, Any], ctx: ObjectiveContext
    ) -> ObjectiveOutput:
        loss_sum, count = spec.packed_forward(
            model, batch, sp_group=ctx.sp_group, loss_backend=ctx.loss_backend
        )
        return ObjectiveOutput(loss_sum=loss_sum, count=count)
