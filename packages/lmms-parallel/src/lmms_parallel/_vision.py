"""Keep the collectives of a sharded vision tower in step when a rank has no media.

Under FSDP2 every vision block all-gathers its weights in forward and reduce-scatters its
gradients in backward. A rank whose batch has no image would skip both while its peers wait
forever. :func:`ensure_vision_participation` runs the tower on a tiny dummy input on such a rank
and returns ``0 * output.sum()``: adding it to the loss makes backward's reduce-scatters run too,
with zero gradient, so the update is unchanged. Cost: one forward+backward of a few patches.

Call it *before* the model forward (peers run the tower first, inside the model, and collective
order must match), and only when the batch has no media.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ensure_vision_participation"]


def _first_tensor(out: Any) -> torch.Tensor:
    if torch.is_tensor(out):
        return out
    if isinstance(out, Mapping):
        values = list(out.values())
    elif hasattr(out, "to_tuple"):
        values = list(out.to_tuple())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        values = []
    for value in values:
        if torch.is_tensor(value) and value.is_floating_point():
            return value
    raise TypeError(f"the vision tower returned no floating-point tensor: {type(out).__name__}")


def ensure_vision_participation(
    vision_tower: nn.Module | None,
    dummy_inputs: Callable[[], dict[str, Any]],
    *,
    has_media: bool,
) -> torch.Tensor | None:
    """Return ``0 * tower(**dummy_inputs()).sum()`` when ``has_media`` is False, else ``None``.

    Args:
        vision_tower: the (FSDP-sharded) vision tower, e.g. ``spec.vision_tower(model)``;
            ``None`` for text-only models (returns ``None``).
        dummy_inputs: builds keyword arguments of a minimal valid tower input (from the model
            spec: e.g. one 2x2-patch image for Qwen-VL).
        has_media: whether this rank's batch has images or videos.

    The returned scalar must be added to the loss before backward. Everything runs under the
    caller's autocast / grad mode; with a frozen tower the forward alone keeps ranks in step.
    """
    if has_media or vision_tower is None:
        return None
    out = _first_tensor(vision_tower(**dummy_inputs()))
    return out.sum() * 0.0
