"""Family-side description of how a vision tower call splits into items for the SP ranks.

``lmms_parallel.SplitVision`` does the splitting (process groups, FLOPs-balanced shares, the
all-gather of the outputs); a family states, per tower call, a ``lmms_parallel.VisionSplitPlan``
through ``spec.vision_split_plan(model, args, kwargs)``. :func:`grid_plan` serves the Qwen-VL
towers (``hidden_states``, ``grid_thw``), whose frames attend only within themselves, so a video
splits by temporal patch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lmms_parallel import VisionSplitPlan

__all__ = ["VisionSplitPlan", "grid_plan"]

Call = tuple[tuple, dict[str, Any]]


def grid_plan(spec: Any, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> VisionSplitPlan:
    """Items of a Qwen-VL tower call ``(hidden_states [patches, D], grid_thw [n, 3])``: each
    image, and each temporal patch of each video (its frames attend within themselves: windows,
    full-attention ``cu_seqlens``, rotary and position-embedding rows are per frame), costed by
    ``spec.vision_flops`` of a ``(1, h, w)`` grid."""
    hidden = args[0] if args else kwargs["hidden_states"]
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "grid_thw")}
    rows = grid.reshape(-1, 3).tolist()  # host grid: no device read (lmms-data keeps it there)
    owners, units = [], []
    for idx, (t, h, w) in enumerate(rows):
        owners += [idx] * t
        units += [h * w] * t
    cost = functools.cache(lambda h, w: float(spec.vision_flops(model.config, [[1, h, w]])))
    costs = [cost(rows[o][1], rows[o][2]) for o in owners]
    starts = [0]
    for u in units:
        starts.append(starts[-1] + u)

    def call(lo: int, hi: int) -> Call:
        sub: list[list[int]] = []
        for o in owners[lo:hi]:
            if sub and sub[-1][3] == o:
                sub[-1][0] += 1
            else:
                sub.append([1, rows[o][1], rows[o][2], o])
        sub_grid = torch.tensor([r[:3] for r in sub], dtype=grid.dtype, device=grid.device)
        return (hidden[starts[lo] : starts[hi]],), {**rest, "grid_thw": sub_grid}

    def dummy() -> Call:
        inputs = spec.dummy_vision_inputs(model, hidden.device)
        x, g = inputs["hidden_states"].to(hidden.dtype), inputs["grid_thw"].to(grid.device)
        return (x,), {**rest, "grid_thw": g}

    merge = model.config.vision_config.spatial_merge_size
    return VisionSplitPlan(units=units, costs=costs, call=call, dummy=dummy, dummy_units=merge**2)
