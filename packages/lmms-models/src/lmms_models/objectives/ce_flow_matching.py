"""``ce_flow_matching``: next-token cross-entropy on text plus flow matching on generation latents,
in one forward of a unified model (BAGEL).

Normalisation. The trainer divides the global sum of ``loss_sum`` by the global sum of
:meth:`CeFlowMatching.count_tokens`. This objective counts *supervised tokens of both kinds*:
``N = N_text + N_latent`` (text positions with a label, plus noised latent tokens), and sums

``loss_sum = ce_weight * sum_text CE_i + fm_weight * sum_latent_tokens MSE_j``

where ``MSE_j`` is the squared velocity error of latent token ``j`` averaged over its
``p * p * C`` values (the flow-matching formulas of :mod:`lmms_models._flow_matching`,
``rectified_flow`` convention, timestep scale 1: the network sees the noise level in [0, 1]).
The logged ``ce`` and ``fm`` metrics are each normalised by their own global count (per text
token, per latent token). The reference BAGEL trainer instead adds the two per-kind means
(``ce_weight * mean CE + mse_weight * mean MSE``); with one global normaliser per step that is
``N * (ce_weight / N_text)`` and ``N * (fm_weight / N_latent)`` here, i.e. the same when the pack's
mix of text and latent tokens is stable; the per-token form keeps every token's gradient
independent of what else happened to be packed with it, which is what makes packed == unpacked
(and gradient accumulation) exact.

Randomness: each noised image draws its time and noise from a generator seeded with
``sample_seeds(ctx.seed, noise_seed)`` (the packer derives ``noise_seed`` from the sample's seed
and the image's index): packed, unpacked, any layout, resumed: the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _flow_matching as fm
from .._capabilities import MixedGeneration
from ._base import Objective, ObjectiveContext, ObjectiveOutput, register_objective
from .flow_matching import sample_seeds

__all__ = ["CeFlowMatching", "CeFlowMatchingOptions", "mixed_terms"]

_BAGEL_FM = {"convention": "rectified_flow", "timestep_scale": 1.0, "time_sampling": "logit_normal"}


@dataclass(kw_only=True, slots=True)
class CeFlowMatchingOptions:
    """``ce_weight`` / ``fm_weight``: the two terms' weights; ``flow_matching``: options of
    :class:`lmms_models._flow_matching.FlowMatchingConfig` over BAGEL's defaults (rectified flow,
    logit-normal noise levels, time input = noise level, ``shift`` = the config's timestep shift)."""

    ce_weight: float = 1.0
    fm_weight: float = 1.0
    flow_matching: dict[str, Any] = field(default_factory=dict)
    fm_config: fm.FlowMatchingConfig | None = None  # built from flow_matching

    def __post_init__(self) -> None:
        if self.ce_weight < 0 or self.fm_weight < 0:
            raise ValueError("ce_flow_matching: weights must be >= 0")
        conf = {**_BAGEL_FM, **self.flow_matching}
        if conf.get("cfg_dropout", 0.0):
            raise ValueError("ce_flow_matching: condition dropout is the data's job (drop text)")
        self.fm_config = fm.FlowMatchingConfig(**conf)


def mixed_terms(
    spec: Any, model: nn.Module, batch: dict[str, Any], cfg: fm.FlowMatchingConfig, seed: int,
    loss_backend: str = "auto",
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``{ce_sum, ce_count, fm_sum, fm_count, per_image [n_noised], t [n_noised]}`` of one row.

    The spec (a :class:`lmms_models.MixedGeneration`) supplies ``prepare_row(model, row)``,
    ``latent_tokens(model, x [C, H, W]) -> [n, d]``,
    ``latent_image(model, tokens [n, d], like [C, H, W]) -> [C, H, W]`` and
    ``mixed_forward(model, batch, tokens [Ng, d], time [Ng]) ->
    (hidden [N_text, H], labels [N_text], predictions [N_noised_tokens, d] or None)`` (the
    supervised text rows' hidden states: the cross-entropy through the spec's ``lm_head`` is
    taken here, fused: ``[N, vocab]`` logits never exist).
    """
    from lmms_kernels import fused_linear_cross_entropy

    batch = spec.prepare_row(model, batch)  # the row on the device, pixels encoded
    latents: list[torch.Tensor] = batch["vae_latents"]
    noised: list[bool] = batch["vae_noised"]
    tokens, times, targets = [], [], []
    if latents:
        seeds = sample_seeds(seed, batch["noise_seed"])
        dev = latents[0].device
        for x1, is_noised, s in zip(latents, noised, seeds, strict=True):
            n_tok = spec.latent_tokens(model, x1).shape[0]
            if is_noised:
                d = fm.draw(cfg, s[None], tuple(x1.shape), dev)
                x_t, _ = fm.interpolant(cfg.path, d.t, x1[None], d.noise)
                tokens.append(spec.latent_tokens(model, x_t[0]))
                times.append(fm.model_time(cfg, d.t).expand(n_tok))
                targets.append((x1, d.noise[0], d.t))
            else:  # clean conditioning latents: noise level 0
                tokens.append(spec.latent_tokens(model, x1))
                times.append(torch.zeros(n_tok, device=dev))
    tok = torch.cat(tokens) if tokens else None
    tim = torch.cat(times) if times else None
    hidden, labels, pred = spec.mixed_forward(model, batch, tok, tim)
    head = spec.lm_head(model)
    ce_sum, ce_n = fused_linear_cross_entropy(
        hidden, head.weight, labels, bias=head.bias, backend=loss_backend
    )
    dev = ce_sum.device
    per_image, ts, fm_sum = [], [], torch.zeros((), device=dev)
    n_fm = 0
    if targets:
        start = 0
        for x1, x0, t in targets:
            n = spec.latent_tokens(model, x1).shape[0]
            out = spec.latent_image(model, pred[start : start + n], x1)
            per = fm.flow_matching_loss(cfg, out[None], x1[None], x0[None], t)  # [1]
            per_image.append(per)
            ts.append(t)
            fm_sum = fm_sum + per[0] * n  # mean over the image's values x its tokens
            start, n_fm = start + n, n_fm + n
    return {
        "ce_sum": ce_sum.float(),
        "ce_count": ce_n,
        "fm_sum": fm_sum.float(),
        "fm_count": torch.tensor(n_fm, device=dev),
        "per_image": torch.cat(per_image) if per_image else torch.zeros(0, device=dev),
        "t": torch.cat(ts) if ts else torch.zeros(0, device=dev),
    }


@register_objective("ce_flow_matching")
class CeFlowMatching(Objective):
    """Cross-entropy + flow matching; normalised per supervised token of either kind."""

    requires = frozenset({"token_lm", "ce_flow_heads"})

    Options = CeFlowMatchingOptions

    def __init__(self, **options: Any) -> None:
        options.pop("fm_config", None)
        super().__init__(**options)

    def count_tokens(self, batch: dict[str, Any]) -> int:
        return int(batch["num_ce_tokens"]) + int(batch["num_fm_tokens"])

    def loss(
        self, spec: Any, model: nn.Module, batch: dict[str, Any], ctx: ObjectiveContext
    ) -> ObjectiveOutput:
        if not isinstance(spec, MixedGeneration):
            raise TypeError(
                "objective ce_flow_matching needs a unified family (understanding and "
                f"generation in one row: lmms_models.MixedGeneration); {spec.name} is not one"
            )
        opt: CeFlowMatchingOptions = self.options
        terms = mixed_terms(spec, model, batch, opt.fm_config, ctx.seed, ctx.loss_backend)
        loss_sum = opt.ce_weight * terms["ce_sum"] + opt.fm_weight * terms["fm_sum"]
        if ctx.sp_group is not None:  # every SP rank holds the whole row's loss: the value is
            # the row's, each rank's gradient share 1/sp (the group's sum is one process's)
            from lmms_parallel import sp_replicated_grad

            loss_sum = sp_replicated_grad(loss_sum, ctx.sp_group)
        count = (terms["ce_count"] + terms["fm_count"]).to(torch.int64)
        ce_n = terms["ce_count"].to(torch.float32)
        fm_n = terms["fm_count"].to(torch.float32)
        metrics = {
            "ce": (terms["ce_sum"].detach(), ce_n),
            "fm": (terms["fm_sum"].detach(), fm_n),
        }
        if terms["t"].numel():
            sums = fm.bucket_sums(opt.fm_config, terms["per_image"], terms["t"])
            for k, v in sums.items():
                if k[0] == "l":
                    metrics["fm_" + k] = (v, sums["count_t/" + k.split("/", 1)[1]])
        return ObjectiveOutput(loss_sum=loss_sum, count=count, metrics=metrics)
