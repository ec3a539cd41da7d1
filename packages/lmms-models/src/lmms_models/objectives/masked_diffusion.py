"""``masked_diffusion``: the masked-diffusion language-model objective (LLaDA, Dream, MDLM).

Per sample ``s`` of a packed row draw a noise level ``t_s ~ U(eps, 1)``; replace each supervised
token (``labels != -100``; SFT prompt tokens, each sample's first token and padding never are) by
the mask token with probability ``t_s``; run the decoder with attention *bidirectional inside
each sample* and never across samples (varlen non-causal); take the cross-entropy of the original
token at the masked positions only, each weighted ``1 / t_s``::

    loss_sum = Σ_s Σ_{i ∈ s, masked} CE(f(x_noised)_i, x_i) / t_s
    loss     = Σ_{global batch} loss_sum / (supervised tokens of the global batch)

The normaliser is the causal LM's (``count_tokens``: the row's supervised tokens), so the value is
the usual Monte-Carlo estimate of the masked-diffusion ELBO bound per token and does not move with
packing, GA, DP or SP. ``shift=True`` is the layout of dLLMs adapted from an autoregressive model
(Dream): position ``i``'s hidden state predicts token ``i + 1`` of the same sample, so the loss
reads the hidden state one position left of every masked token.

The draws come from :mod:`._mask_rng`: a function of ``(seed, step, sample tokens, position)``,
the same in every layout and after a resume. The logits are never built: the loss is
``lmms_kernels.fused_linear_cross_entropy`` with ``token_weights`` (the 1/t), and its
``token_stats`` (per-token CE and argmax hit) give the metrics for free:

* ``md/masked_loss``, ``md/masked_acc``: unweighted CE and accuracy per masked token;
* ``md/mask_ratio``: masked / supervised tokens (≈ mean t ≈ (1 + eps) / 2);
* ``md/loss_t{a}-{b}``, ``md/acc_t{a}-{b}``: the same per bucket of ``t`` (``t_buckets`` equal
  bins of ``[0, 1]``); accuracy should fall as ``t`` grows (less context is left).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._spec import IGNORE_INDEX
from ._base import Objective, ObjectiveContext, ObjectiveOutput, register_objective
from ._mask_rng import mix31, sample_keys, segment_ids, uniform31

__all__ = ["MaskedDiffusion", "MaskedDiffusionOptions", "draw_masks", "make_bidirectional"]


@dataclass(kw_only=True, slots=True)
class MaskedDiffusionOptions:
    """Options of ``masked_diffusion`` (``model_config.objective_args`` in lmms-train)."""

    mask_token_id: int | None = None
    """Id of the mask token. Default: the model config's ``mask_token_id`` (set by dLLM
    checkpoints); one of the two is required. Must lie inside the embedding table."""
    eps: float = 1e-3
    """Lower end of ``t ~ U(eps, 1)``: bounds the ``1/t`` weight by ``1/eps``."""
    shift: bool | None = None
    """Predict token ``i+1`` from position ``i`` (Dream, AR-initialised dLLMs) instead of token
    ``i`` from position ``i`` (LLaDA, MDLM). Default: the model config's ``lmms_diffusion_shift``
    (written by lmms exports; lmms-train sets it for Dream-layout folders), else false."""
    t_buckets: int = 4
    """Number of equal ``t`` bins of the per-bucket loss/accuracy metrics (0: none)."""


def make_bidirectional(spec: Any, model: nn.Module) -> int:
    """Make the text decoder's self-attention non-causal; return how many modules changed.

    Sets ``is_causal = False`` on every attention module of ``spec.text_model(model)`` (lmms'
    registered varlen function, transformers' SDPA/eager/flash functions and lmms-parallel's
    Ulysses wrapper all read it) and on the text config, where transformers' mask builder then
    makes bidirectional masks for upstream reference runs, and ``save_pretrained`` records it.
    The vision tower (already bidirectional) is untouched. Attention stays inside each packed
    sample: the segments come from ``cu_seqlens`` as for causal runs.
    """
    text = spec.text_model(model)
    changed = 0
    for mod in text.modules():
        if hasattr(mod, "is_causal") and hasattr(mod, "config") and mod is not text:
            mod.is_causal = False
            changed += 1
    if changed == 0:
        raise NotImplementedError(
            f"{spec.name}: found no attention module with an is_causal flag in the text decoder"
        )
    for cfg in {id(c): c for c in (spec.text_config(model.config), model.config)}.values():
        cfg.is_causal = False
    return changed


def draw_masks(
    input_ids: torch.Tensor,  # [T] int64
    labels: torch.Tensor,  # [T] int64, IGNORE_INDEX where unsupervised
    cu_seqlens: torch.Tensor,  # [n+1] int32
    *,
    seed: int,
    step: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t [T] float64: each token's sample noise level, masked [T] bool)``.

    ``t_s = eps + (1 - eps) · u_s`` and ``masked_i = supervised_i ∧ u_i < t_s`` with the
    counter-based uniforms of :mod:`._mask_rng` (layout-independent, resumable by construction).
    """
    keys, seg, pos = sample_keys(input_ids, cu_seqlens, seed=seed, step=step)
    t_seg = eps + (1.0 - eps) * uniform31(keys)  # [n]
    t_tok = t_seg[seg]  # [T]
    u_tok = uniform31(keys[seg] ^ mix31(pos + 1))  # [T]
    masked = (labels.reshape(-1) != IGNORE_INDEX) & (u_tok < t_tok)
    return t_tok, masked


@register_objective("masked_diffusion")
class MaskedDiffusion(Objective):
    """Masked diffusion with 1/t weighting; see the module docstring for the exact loss."""

    requires = frozenset({"token_lm", "bidirectional_text"})
    layout_shift = True

    Options = MaskedDiffusionOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        if not 0.0 < o.eps < 1.0:
            raise ValueError(f"masked_diffusion: eps must be in (0, 1), got {o.eps}")
        if o.t_buckets < 0:
            raise ValueError(f"masked_diffusion: t_buckets must be >= 0, got {o.t_buckets}")
        self.mask_token_id: int | None = o.mask_token_id

    # ------------------------------------------------------------------ model
    def prepare_model(self, spec: Any, model: nn.Module) -> None:
        cfg = spec.text_config(model.config)
        if self.mask_token_id is None:
            self.mask_token_id = getattr(cfg, "mask_token_id", None) or getattr(
                model.config, "mask_token_id", None
            )
        if self.mask_token_id is None:
            raise ValueError(
                "masked_diffusion needs a mask token id: set objective_args.mask_token_id "
                "(or mask_token_id in the model config)"
            )
        vocab = int(cfg.vocab_size)
        if not 0 <= int(self.mask_token_id) < vocab:
            raise ValueError(
                f"masked_diffusion: mask_token_id {self.mask_token_id} is outside the "
                f"embedding table (vocab_size {vocab})"
            )
        if self.options.shift is None:
            self.options.shift = bool(getattr(cfg, "lmms_diffusion_shift", False))
        make_bidirectional(spec, model)
        for c in {id(x): x for x in (cfg, model.config)}.values():
            c.mask_token_id = int(self.mask_token_id)  # recorded by save_pretrained
            c.lmms_diffusion_shift = bool(self.options.shift)

    def count_tokens(self, batch: dict[str, Any]) -> int:
        """Supervised tokens of the row (the causal LM's count when the collator leaves each
        sample's first token unsupervised, as lmms-pack does)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    # ------------------------------------------------------------------ loss
    def targets(
        self, batch: dict[str, Any], device: torch.device, ctx: ObjectiveContext
    ) -> dict[str, torch.Tensor]:
        """The row's draw: ``noised [T]`` inputs, ``target [T]`` (IGNORE_INDEX where no loss),
        ``weight [T]`` (1/t), ``t [T]`` and ``masked [T]``, aligned with the hidden states."""
        if self.mask_token_id is None:
            raise RuntimeError("masked_diffusion: prepare_model was not called on this model")
        ids = batch["input_ids"].to(device, non_blocking=True).reshape(-1)  # [T]
        labels = batch["labels"].to(device, non_blocking=True).reshape(-1)  # [T]
        cu = batch["cu_seqlens"].to(device, torch.int32, non_blocking=True)  # [n+1]
        t, masked = draw_masks(ids, labels, cu, seed=ctx.seed, step=ctx.step, eps=self.options.eps)
        noised = torch.where(masked, torch.full_like(ids, int(self.mask_token_id)), ids)
        target = torch.where(masked, labels, torch.full_like(labels, IGNORE_INDEX))
        t_row = t
        if self.options.shift:  # hidden i predicts token i+1 of the same sample
            seg = segment_ids(cu, ids.numel())  # [T]
            same = seg[1:] == seg[:-1]  # [T-1]: i and i+1 in one sample (no host read)
            shifted = torch.full_like(target, IGNORE_INDEX)
            shifted[:-1] = torch.where(same, target[1:], IGNORE_INDEX)
            target = shifted
            t_row = torch.ones_like(t)
            t_row[:-1] = t[1:]
        weight = (target != IGNORE_INDEX) / t_row  # [T] fp64 -> fp32 in the kernel
        return {"noised": noised, "target": target, "weight": weight.float(), "t": t_row}

    def loss(
        self, spec: Any, model: nn.Module, batch: dict[str, Any], ctx: ObjectiveContext
    ) -> ObjectiveOutput:
        from lmms_kernels import fused_linear_cross_entropy

        head = spec.lm_head(model)
        dev = head.weight.device
        d = self.targets(batch, dev, ctx)
        n_sup = (batch["labels"].to(dev).reshape(-1) != IGNORE_INDEX).sum()  # int64 scalar
        hidden, out = spec.packed_hidden(model, batch, input_ids=d["noised"])  # [T(/sp), H]
        target, weight, t = d["target"], d["weight"], d["t"]
        if ctx.sp_group is not None:
            from lmms_parallel import sp_shard_labels

            # this rank's slice: the row's token indices, padded with IGNORE_INDEX like labels
            idx = sp_shard_labels(torch.arange(target.numel(), device=dev), ctx.sp_group)
            keep = idx != IGNORE_INDEX
            safe = idx.clamp(min=0)
            target = torch.where(keep, target[safe], torch.full_like(idx, IGNORE_INDEX))
            weight, t = weight[safe] * keep, t[safe]
        loss_sum, _, rows, hit = fused_linear_cross_entropy(
            hidden,
            head.weight,
            target,
            bias=head.bias,
            backend=ctx.loss_backend,
            token_weights=weight,
            token_stats=True,
        )
        sp = 1 if ctx.sp_group is None else torch.distributed.get_world_size(ctx.sp_group)
        extra = spec.extra_loss(model, out, batch, sp_group=ctx.sp_group)
        if extra is not None:  # e.g. an MoE router's auxiliary term, per supervised token
            loss_sum = loss_sum + extra * (n_sup / sp)  # summed over the SP group below
        if ctx.sp_group is not None:
            from lmms_parallel import sp_reduce_loss

            loss_sum, _ = sp_reduce_loss(loss_sum, n_sup, ctx.sp_group)
        metrics = self._metrics(target != IGNORE_INDEX, rows, hit, t, n_sup / sp)
        return ObjectiveOutput(loss_sum=loss_sum, count=n_sup, metrics=metrics)

    def _metrics(
        self,
        on: torch.Tensor,  # [T'] bool: positions with a loss (masked tokens) on this rank
        rows: torch.Tensor,  # [T'] fp32 unweighted CE
        hit: torch.Tensor,  # [T'] bool
        t: torch.Tensor,  # [T'] fp64
        n_sup: torch.Tensor,  # this rank's share of the row's supervised tokens
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's metric sums (SP ranks hold disjoint slices, so plain sums over every
        rank are the row's; the supervised count is shared by the SP group, so it is split)."""
        n_on = on.sum().double()
        rows, hit = rows.double(), hit.double()
        out = {
            "md/masked_loss": (rows.sum(), n_on),
            "md/masked_acc": (hit.sum(), n_on),
            "md/mask_ratio": (n_on, n_sup.double()),
        }
        nb = self.options.t_buckets
        if nb:
            bucket = (t * nb).long().clamp_(0, nb - 1)  # [T']
            ones = on.double()
            cnt = torch.zeros(nb, dtype=torch.float64, device=on.device)
            loss_b, hit_b = torch.zeros_like(cnt), torch.zeros_like(cnt)
            cnt.index_add_(0, bucket, ones)
            loss_b.index_add_(0, bucket, rows * ones)
            hit_b.index_add_(0, bucket, hit * ones)
            for b in range(nb):
                tag = f"t{b / nb:.2f}-{(b + 1) / nb:.2f}"
                out[f"md/loss_{tag}"] = (loss_b[b], cnt[b])
                out[f"md/acc_{tag}"] = (hit_b[b], cnt[b])
        return out
