"""Optimizer and schedule from `trainer_args`: AdamW, or Muon for every family.

Muon's parameter split is model-agnostic: it goes by the spec's hooks and module types, not
parameter names: 2-D weights of the decoder and vision blocks take Muon; embeddings, the LM head,
norms, biases and the taps of grouped (depthwise) convolutions take AdamW (their update geometry
is not a matrix one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmms_train._schedule import ScheduleConfig, build_scheduler
from lmms_train.config import TrainerArgs

__all__ = ["build_optimizer", "build_schedule"]


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or name.endswith(".bias")


def _grouped_convs(model: nn.Module) -> list[nn.Module]:
    """Grouped convolutions (``groups > 1``; depthwise ones such as Gated DeltaNet's short
    convolutions, ``[C, 1, K]``): each group's few taps are their own tiny matrix, so the
    flattened ``[C, K]`` kernel is no matrix for Muon to orthogonalise."""
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [m for m in model.modules() if isinstance(m, convs) and m.groups > 1]


def build_optimizer(
    model: nn.Module, spec: Any, t: TrainerArgs, master: Any = None
) -> torch.optim.Optimizer:
    """AdamW (no decay on norms/biases) or Muon over the trainable parameters of `model`; with
    `master` (`lmms_parallel.MasterWeights`) over their fp32 masters, written back into the
    model after every step (inside the step with `fused_master_step` / `muon_fused_step`:
    `lmms_optim.MasterAdamW` / `MasterMuon`)."""
    optimizer = _build(model, spec, t, master)
    if master is not None:
        master.attach(optimizer)
    return optimizer


def _build(model: nn.Module, spec: Any, t: TrainerArgs, master: Any) -> torch.optim.Optimizer:
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    # the model's names and modules decide the groups; the optimizer steps the masters, if any
    stepped = master.map_params(list(params)) if master is not None else list(params)
    if t.optimizer == "adamw":
        return _adamw(list(zip(names, stepped, strict=True)), t, master)
    if t.optimizer_state_dtype != "float32":
        raise ValueError(
            f"trainer_args.optimizer_state_dtype: {t.optimizer_state_dtype} state is AdamW's "
            "(lmms_optim.LowPrecisionAdamW); Muon keeps fp32 state: set it to float32"
        )
    from lmms_optim import Muon

    groups = _muon_groups(model, spec, list(params), stepped, t)
    if master is not None and t.muon_fused_step:
        from lmms_optim import MasterMuon

        cls: type[Muon] = MasterMuon
    else:
        cls = Muon
    return cls(
        groups,
        lr=t.muon_learning_rate or t.learning_rate,
        momentum=t.muon_momentum,
        adjust_lr="rms",
    )


def _adamw(
    named: list[tuple[str, torch.Tensor]], t: TrainerArgs, master: Any
) -> torch.optim.Optimizer:
    """AdamW with weight decay on all but norms and biases: bf16 moments with stochastic rounding
    (`optimizer_state_dtype: bfloat16`), the fused master step, or torch's (fused on CUDA)."""
    decay = [p for n, p in named if not _no_decay(n, p)]
    other = [p for n, p in named if _no_decay(n, p)]
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": other, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    if t.optimizer_state_dtype == "bfloat16":  # bf16 moments, stochastic rounding
        from lmms_optim import LowPrecisionAdamW

        return LowPrecisionAdamW(
            groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon, state_dtype=torch.bfloat16, seed=t.seed,
        )  # fmt: skip
    if master is not None and t.fused_master_step:
        from lmms_optim import MasterAdamW

        return MasterAdamW(
            groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon
        )
    kwargs: dict[str, Any] = {}
    if any(p.is_cuda for _, p in named):
        kwargs["fused"] = True
    return torch.optim.AdamW(
        groups,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        **kwargs,
    )


def _muon_groups(
    model: nn.Module, spec: Any, params: list[nn.Parameter], stepped: list[Any], t: TrainerArgs
) -> list[dict[str, Any]]:
    """Muon's groups: the matrices (`params`' 2-D and up, outside the spec's exclusions), MoE
    expert stacks `[E, m, n]` (each of the E matrices orthogonalised on its own: `stacked`), and
    AdamW for the rest; `stepped` holds what the optimizer steps (the masters, if any)."""
    from lmms_models import HasExperts

    excluded = _muon_excluded(model, spec)
    takes_muon = [p.ndim >= 2 and id(p) not in excluded for p in params]
    experts = spec.experts_modules(model) if isinstance(spec, HasExperts) else []
    stack_ids = {id(p) for m in experts for p in m.parameters() if p.ndim == 3}
    is_stack = [id(p) in stack_ids for p in params]
    muon = [p for p, m, st in zip(stepped, takes_muon, is_stack, strict=True) if m and not st]
    stacks = [p for p, m, st in zip(stepped, takes_muon, is_stack, strict=True) if m and st]
    adamw = [p for p, m in zip(stepped, takes_muon, strict=True) if not m]
    groups = []
    for members, stacked in ((muon, False), (stacks, True)):
        if members:
            groups.append(
                {
                    "params": members,
                    "use_muon": True,
                    "stacked": stacked,
                    "lr": t.muon_learning_rate or t.learning_rate,
                    "momentum": t.muon_momentum,
                    "weight_decay": t.weight_decay,
                }
            )
    if adamw:
        groups.append(
            {
                "params": adamw,
                "use_muon": False,
                "lr": t.learning_rate,
                "betas": (t.adam_beta1, t.adam_beta2),
                "eps": t.adam_epsilon,
                "weight_decay": 0.0,
            }
        )
    return groups


def _muon_excluded(model: nn.Module, spec: Any) -> set[int]:
    """Muon's exclusions, by the model's own modules: embeddings, the LM head, grouped
    convolutions and the family's own (`spec.muon_adamw_modules`)."""
    modules = [
        *spec.embeddings(model),
        spec.lm_head(model),
        *_grouped_convs(model),
        *spec.muon_adamw_modules(model),
    ]
    return {id(p) for m in modules for p in m.parameters()}


def build_schedule(
    optimizer: torch.optim.Optimizer, t: TrainerArgs
) -> torch.optim.lr_scheduler.LambdaLR:
    if t.max_steps < 0:  # the run ends with the data: no length to decay over (docs/trainer.md)
        return build_scheduler(optimizer, ScheduleConfig(kind="constant", max_steps=1,
                                                         warmup_steps=t.warmup_steps))  # fmt: skip
    warmup = t.warmup_steps or round(t.warmup_ratio * t.max_steps)
    sc = ScheduleConfig(
        kind=t.lr_scheduler_type,
        max_steps=t.max_steps,
        warmup_steps=warmup,
        min_lr_ratio=t.min_lr_ratio,
        wsd_decay_ratio=t.wsd_decay_ratio,
    )
    return build_scheduler(optimizer, sc)
