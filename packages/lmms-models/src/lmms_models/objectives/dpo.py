"""``dpo``: direct preference optimisation on packed preference pairs (sigmoid DPO, or IPO).

Data (``dataset_type: preference``, lmms_data): every sample of the row is a pair of two documents,
chosen then rejected, each the whole prompt with its media plus one answer (``segments``). A
document's log-probability is the sum of its answer tokens' log-probabilities
(``log π(y|x) = -Σ CE``, prompt tokens unsupervised), so documents never need to see each other:
per-document causal varlen attention keeps them apart exactly.

Per pair, with ``Δ = log π(y) - log π_ref(y)``:

* ``sigmoid`` (DPO): ``loss = -log σ(β (Δ_chosen - Δ_rejected))``, label smoothing ``ε`` mixes in
  ``-log σ(-β(...))`` (conservative DPO);
* ``ipo``: ``loss = ((Δ_chosen - Δ_rejected) / n - 1/(2β))²`` with the log-probabilities averaged
  over each answer's tokens (IPO's per-token form, as TRL computes it).

Reference log-probabilities come from the same model with its LoRA adapters off
(``ObjectiveContext.reference``: no second model in memory), under ``no_grad``. The normaliser is
the number of pairs (:meth:`DPO.count_tokens`): the trainer's ``Σ loss_sum / Σ count`` over the
global batch is the mean loss per pair, whatever the packing, GA or world size.

The ``[T, vocab]`` logits are never built: the LM head runs through lmms_kernels' fused linear
cross-entropy twice on the policy's hidden states, once without gradients for the per-token
log-probabilities (``token_stats``), then with ``token_weights`` ``w_t = -∂L/∂log π(doc(t))`` so
that ``Σ w_t CE_t`` has exactly the DPO loss's gradient (one extra LM-head forward, no extra
decoder pass). Metrics: ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/margin``
(``β Δ``), ``dpo/accuracy`` (chosen reward > rejected), ``dpo/logp_chosen``,
``dpo/logp_rejected``, per pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._spec import IGNORE_INDEX, batch_shift_labels
from ._base import Objective, ObjectiveContext, ObjectiveOutput, register_objective

__all__ = ["DPO", "DPOOptions", "dpo_pair_losses"]


@dataclass(kw_only=True, slots=True)
class DPOOptions:
    """Options of ``dpo`` (``model_config.objective_args`` in lmms-train)."""

    beta: float = 0.1
    """Strength of the KL anchor to the reference (DPO's β)."""
    loss_type: str = "sigmoid"
    """``sigmoid`` (DPO) or ``ipo``."""
    label_smoothing: float = 0.0
    """Conservative DPO's ε (``sigmoid`` only): the chance a preference label is flipped."""
    reference: str = "adapters_off"
    """``adapters_off``: the reference is the model with its LoRA adapters off (computed each
    step, no gradient); ``precomputed``: the pairs carry ``ref_chosen_logps`` /
    ``ref_rejected_logps`` (sums over each answer's tokens), e.g. for full fine-tuning."""

    def __post_init__(self) -> None:
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"dpo loss_type {self.loss_type!r}: use sigmoid or ipo")
        if self.beta <= 0:
            raise ValueError(f"dpo beta must be > 0, got {self.beta}")
        if self.reference not in ("adapters_off", "precomputed"):
            raise ValueError(f"dpo reference {self.reference!r}: use adapters_off or precomputed")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


def dpo_pair_losses(
    logp: torch.Tensor,  # [2P] fp32 (chosen, rejected, chosen, ...)
    ref: torch.Tensor,  # [2P]
    n_tokens: torch.Tensor,  # [2P] answer tokens per document
    opts: DPOOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses ``[P]`` and per-document rewards ``β Δ [2P]``."""
    if opts.loss_type == "ipo":
        per_tok = (logp - ref) / n_tokens.clamp(min=1)
        h = per_tok[0::2] - per_tok[1::2]
        losses = (h - 1.0 / (2.0 * opts.beta)) ** 2
    else:
        z = opts.beta * ((logp[0::2] - ref[0::2]) - (logp[1::2] - ref[1::2]))
        eps = opts.label_smoothing
        losses = -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
    return losses, opts.beta * (logp - ref).detach()


def _doc_ids(cu: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[T]`` int64: the document (segment of ``cu_seqlens``) of every position."""
    lens = (cu[1:] - cu[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, 0)[:n_tokens]


@register_objective("dpo")
class DPO(Objective):
    """Preference optimisation on pairs of documents; normalised per pair of the global batch."""

    Options = DPOOptions
    preference = True

    def needs_reference(self) -> bool:
        return self.options.reference == "adapters_off"

    @classmethod
    def family_problem(cls, spec: Any) -> str | None:
        """Besides a language model: rows of token documents (the family's declared data plan),
        which lmms-data's preference processor fills with chosen/rejected pairs. A family whose
        rows are packed by the model (``ModelPackedRows``, e.g. BAGEL's interleaved parts) has no
        such pairs."""
        from .._data_plan import ModelPackedRows

        problem = super().family_problem(spec)
        if problem is None and isinstance(spec.data_plan(spec.tiny_config), ModelPackedRows):
            problem = (
                f"objective 'dpo' trains on token rows of preference pairs; {spec.name}'s rows "
                "are packed by the model (its own data plan), which has no preference pairs"
            )
        return problem

    def count_tokens(self, batch: dict[str, Any]) -> int:
        segs = batch.get("sample_segments")
        if segs is None:
            raise ValueError(
                "objective dpo needs preference pairs: set dataset_config.dataset_type: preference"
            )
        return len(segs)

    def _doc_logps(self, spec, model, batch, shift, docs, n_docs, ctx, *, grad: bool):
        """``(hidden [T(/sp), H], per-document Σ log p [n_docs])``; ``shift`` and ``docs`` are
        this rank's slice under SP, the sums are the whole row's (summed over the SP group)."""
        from lmms_kernels import fused_linear_cross_entropy

        hidden, _ = spec.packed_hidden(model, batch)
        head = spec.lm_head(model)
        with torch.no_grad():
            _, _, tok_ce, _ = fused_linear_cross_entropy(
                hidden.detach(), head.weight.detach(), shift,
                bias=None if head.bias is None else head.bias.detach(),
                backend=ctx.loss_backend, token_stats=True,
            )  # fmt: skip
            sums = torch.zeros(n_docs + 1, dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, docs, tok_ce.float())  # index n_docs: padding, dropped
            if ctx.sp_group is not None:
                import torch.distributed as dist

                dist.all_reduce(sums, group=ctx.sp_group)
        return (hidden if grad else None), -sums[:n_docs]

    def loss(
        self, spec: Any, model: nn.Module, batch: dict[str, Any], ctx: ObjectiveContext
    ) -> ObjectiveOutput:
        from lmms_kernels import fused_linear_cross_entropy

        opts: DPOOptions = self.options
        n_pairs = self.count_tokens(batch)
        head = spec.lm_head(model)
        dev = head.weight.device
        cu = batch["cu_seqlens"].to(dev, torch.int32, non_blocking=True)  # [n+1]
        shift = batch_shift_labels(batch, cu, dev)  # [T]
        n_docs = 2 * n_pairs
        docs = _doc_ids(cu, shift.numel()).clamp_(max=n_docs)  # [T]; padding: index n_docs
        shift = torch.where(docs < n_docs, shift, torch.full_like(shift, IGNORE_INDEX))
        answer = torch.zeros(n_docs + 1, dtype=torch.float32, device=dev)
        answer.index_add_(0, docs, (shift != IGNORE_INDEX).float())
        answer = answer[:n_docs]
        if ctx.sp_group is not None:  # this rank's slice of the row (as the decoder sees it)
            from lmms_parallel import sp_shard_labels

            shift = sp_shard_labels(shift, ctx.sp_group)  # padded with -100
            docs = sp_shard_labels(docs, ctx.sp_group).clamp_(min=0, max=n_docs)
            docs = torch.where(shift != IGNORE_INDEX, docs, torch.full_like(docs, n_docs))

        ref = self._reference(spec, model, batch, shift, docs, n_docs, ctx)
        hidden, logp = self._doc_logps(spec, model, batch, shift, docs, n_docs, ctx, grad=True)
        leaf = logp.detach().requires_grad_(True)
        with torch.enable_grad():
            losses, rewards = dpo_pair_losses(leaf, ref, answer, opts)
            (g,) = torch.autograd.grad(losses.sum(), leaf)
        total = losses.detach().sum()
        if torch.is_grad_enabled():  # Σ w_t CE_t has the DPO loss's gradient (this rank's part)
            g = torch.cat([g, g.new_zeros(1)])  # the padding index
            weights = -g[docs] * (shift != IGNORE_INDEX).float()  # [T(/sp)] fp32
            s, _ = fused_linear_cross_entropy(
                hidden, head.weight, shift, bias=head.bias, backend=ctx.loss_backend,
                token_weights=weights,
            )  # fmt: skip
            total = s - s.detach() + total
        return ObjectiveOutput(
            loss_sum=total,
            count=torch.tensor(n_pairs, dtype=torch.int64, device=dev),
            metrics=self._metrics(rewards, logp.detach(), n_pairs, dev),
        )

    def _reference(self, spec, model, batch, shift, docs, n_docs, ctx) -> torch.Tensor:
        """Per-document reference log-probabilities: the pairs' precomputed ones, or the model
        with its adapters off."""
        if not self.needs_reference():
            if batch.get("ref_logps") is None:
                raise ValueError(
                    "dpo reference: precomputed, but the pairs carry no ref_chosen_logps / "
                    "ref_rejected_logps"
                )
            dev = shift.device
            return batch["ref_logps"].to(dev, torch.float32, non_blocking=True).reshape(-1)
        if ctx.reference is None:
            raise ValueError(
                "objective dpo needs a reference model: train LoRA adapters (model_config.lora; "
                "the reference is the base with the adapters off)"
            )
        with torch.no_grad(), ctx.reference():
            _, ref = self._doc_logps(spec, model, batch, shift, docs, n_docs, ctx, grad=False)
        return ref

    @staticmethod
    def _metrics(rewards, logp, n_pairs, dev) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        den = torch.tensor(float(n_pairs), dtype=torch.float64, device=dev)
        rc, rr = rewards[0::2].double(), rewards[1::2].double()
        return {
            "dpo/rewards_chosen": (rc.sum(), den),
            "dpo/rewards_rejected": (rr.sum(), den),
            "dpo/margin": ((rc - rr).sum(), den),
            "dpo/accuracy": ((rc > rr).double().sum(), den),
            "dpo/logp_chosen": (logp[0::2].double().sum(), den),
            "dpo/logp_rejected": (logp[1::2].double().sum(), den),
        }
