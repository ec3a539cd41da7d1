"""Learning-rate schedules as multipliers of the peak LR (a `LambdaLR`, whose state resumes).

All schedules share a linear warmup from 0; then `constant`, `linear` or `cosine` decay to
`min_lr_ratio` at `max_steps`, or `wsd` (warmup-stable-decay: flat, then a linear decay over the
last `wsd_decay_ratio` of the run), which lets a run be extended from a stable-phase checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ScheduleConfig", "build_scheduler", "lr_multiplier"]


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    kind: str = "cosine"
    max_steps: int = 100
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    wsd_decay_ratio: float = 0.1


def lr_multiplier(step: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak LR for the update at 0-based `step`."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    lo = cfg.min_lr_ratio
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "wsd":
        decay = max(1, round(cfg.wsd_decay_ratio * cfg.max_steps))
        start = cfg.max_steps - decay
        if step < start:
            return 1.0
        frac = min(1.0, (step - start + 1) / decay)
        return 1.0 - (1.0 - lo) * frac
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    frac = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.kind == "linear":
        return 1.0 - (1.0 - lo) * frac
    if cfg.kind == "cosine":
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"unknown schedule {cfg.kind!r}; choose from constant, linear, cosine, wsd")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` over every param group (each group's own initial LR is the peak)."""
    lr_multiplier(0, cfg)  # validate the kind early
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
