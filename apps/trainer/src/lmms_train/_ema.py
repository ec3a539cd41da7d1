"""EMA of the trained weights (`trainer_args.ema_decay`), for any family.

The shadow of each parameter the optimizer steps lives in that parameter's *optimizer state*
(`optimizer.state[p]["lmms_ema"]`), updated by a step post-hook
(`shadow <- decay * shadow + (1 - decay) * p`). So it is:

* sharded like the parameter under FSDP2 (a DTensor clone of the shard: the update is local),
  and over the fp32 masters when bf16 runs on one process (the optimizer steps those);
* saved and resumed bit for bit with the optimizer's state (DCP), with no checkpoint format of
  its own; a skipped step (`on_nonfinite: skip`) does not move it;
* exported next to the model: `<output_dir>/hf_ema/` holds the EMA weights in the same layout
  as `hf/` (`ema_weights` swaps them in for the export and back).

A parameter's shadow starts from its value after its first optimizer step (the hook runs after
the optimizer has created its own state for the stepped parameters, so optimizers that create
their state lazily never find a half-made one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["KEY", "ema_weights", "install_ema"]

KEY = "lmms_ema"


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def install_ema(optimizer: torch.optim.Optimizer, decay: float) -> Any:
    """Keep an EMA of ``optimizer``'s parameters; returns the hook handle (``.remove()``)."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"ema_decay must be in (0, 1), got {decay}")

    @torch.no_grad()
    def update(opt: torch.optim.Optimizer, *_: Any) -> None:
        for p in _params(opt):
            state = opt.state.get(p)
            if not state and p.grad is None:  # not stepped yet: nothing to average
                continue
            state = opt.state[p]
            shadow = state.get(KEY)
            if shadow is None:
                state[KEY] = p.detach().clone()
            else:
                shadow.lerp_(p.detach(), 1.0 - decay)

    return optimizer.register_step_post_hook(update)


@contextlib.contextmanager
def ema_weights(optimizer: torch.optim.Optimizer) -> Iterator[int]:
    """Swap the EMA shadows into the parameters (yields how many) and back afterwards."""
    swapped = []
    with torch.no_grad():
        for p in _params(optimizer):
            shadow = optimizer.state.get(p, {}).get(KEY)
            if shadow is not None:
                tmp = p.detach().clone()
                p.copy_(shadow)
                swapped.append((p, tmp))
    try:
        yield len(swapped)
    finally:
        with torch.no_grad():
            for p, tmp in swapped:
                p.copy_(tmp)
