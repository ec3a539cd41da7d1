"""What the optimizers' ``step`` methods share."""

from __future__ import annotations

from collections.abc import Callable

import torch


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The loss of an optimizer step's ``closure``, run with gradients enabled (``step`` runs
    under ``no_grad``); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
