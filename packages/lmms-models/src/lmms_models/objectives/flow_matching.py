"""``flow_matching``: denoise latents along a stochastic interpolant (SiT, Wan).

Options are :class:`lmms_models._flow_matching.FlowMatchingConfig` (path, prediction, loss
weight, timestep sampling and shift, CFG dropout, convention). The model spec must be a
:class:`lmms_models.DiffusionSpec`: it provides the clean latents and the condition of a latent
batch, the null condition and the network call. The loss of a micro-batch is the sum over its
samples of each sample's mean squared error; the trainer divides by the global sample count.

Randomness: each sample's time, CFG drop and noise come from a generator seeded by
``hash(ctx.seed, noise_seed[i])``, where the data side derives ``noise_seed`` from the record's
position: a resumed run draws them bit for bit, whatever the layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _flow_matching as fm
from ._base import Objective, ObjectiveContext, ObjectiveOutput, register_objective

__all__ = ["FlowMatching", "sample_seeds"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads the run seed over the 63-bit range


def sample_seeds(run_seed: int, noise_seed: torch.Tensor) -> torch.Tensor:
    """Per-sample generator seeds ``[B]`` from the run's seed and the batch's ``noise_seed``."""
    base = (int(run_seed) * _MIX) & 0x7FFF_FFFF_FFFF_FFFF
    return (noise_seed.to("cpu", torch.int64) ^ base) & 0x7FFF_FFFF_FFFF_FFFF


@register_objective("flow_matching")
class FlowMatching(Objective):
    """Flow matching on the spec's latents; normalised per sample of the global batch."""

    requires = frozenset({"latent_denoiser"})

    Options = fm.FlowMatchingConfig

    def count_tokens(self, batch: dict[str, Any]) -> int:
        return int(batch["num_loss_tokens"])

    def loss(
        self, spec: Any, model: nn.Module, batch: dict[str, Any], ctx: ObjectiveContext
    ) -> ObjectiveOutput:
        from .._diffusion import DiffusionSpec

        if not isinstance(spec, DiffusionSpec):
            raise TypeError(
                f"objective flow_matching needs a diffusion-transformer family (sit, wan); "
                f"{spec.name} is a language model"
            )
        cfg: fm.FlowMatchingConfig = self.options
        x1, cond = spec.diffusion_inputs(model, batch)  # [B, ...] fp32
        if "noise_seed" not in batch:
            raise KeyError("a latent batch needs noise_seed [B] (see lmms_models._diffusion)")
        seeds = sample_seeds(ctx.seed, batch["noise_seed"])
        draws = fm.draw(cfg, seeds, tuple(x1.shape[1:]), x1.device)
        x_t, _ = fm.interpolant(cfg.path, draws.t, x1, draws.noise)
        if cfg.cfg_dropout > 0:
            cond = spec.drop_condition(model, cond, draws.drop.to(x1.device))
        out = spec.denoise(model, x_t, fm.model_time(cfg, draws.t), cond)
        per = fm.flow_matching_loss(cfg, out, x1, draws.noise, draws.t)  # [B]
        sums = fm.bucket_sums(cfg, per, draws.t)
        metrics = {
            k: (v, sums["count_t/" + k.split("/", 1)[1]]) for k, v in sums.items() if k[0] == "l"
        }
        count = torch.tensor(x1.shape[0], dtype=torch.int64, device=x1.device)
        return ObjectiveOutput(loss_sum=per.sum(), count=count, metrics=metrics)
