"""Split the vision tower's work across the ranks of a Ulysses SP group (every VL family).

Every rank of an SP group holds the same pack. :class:`SplitVision` hooks the vision tower: each
call is cut into the family's *items* (an image, a video's temporal patch, an anyres view, a
frame: what the tower encodes independently), the items are shared out in contiguous ranges
balanced by their FLOPs (``lmms_parallel.split_contiguous`` on ``spec.vision_flops``), each rank
runs the tower on its range only, and the outputs are all-gathered in pack order
(``lmms_parallel.gather_rows``), so the multimodal merge, Qwen3-VL's deepstack and the Ulysses
slicing run exactly as without the split. Gradients: each rank's rows receive the sum of every
rank's gradient for them, so the tower's parameter gradients equal the unsplit run's (FSDP sums
them over the group as for the decoder). A rank whose range is empty runs the tower on the
family's dummy input and contributes zero rows, which keeps FSDP's collectives in step.

The family describes its tower call through ``spec.vision_split_plan(model, args, kwargs)``
(:class:`VisionSplitPlan`); :func:`grid_plan` serves the Qwen-VL towers (``hidden_states``,
``grid_thw``), whose frames attend only within themselves, so a video splits by temporal patch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

__all__ = ["SplitVision", "VisionSplitPlan", "grid_plan"]

Call = tuple[tuple, dict[str, Any]]


@dataclass(kw_only=True, slots=True)
class VisionSplitPlan:
    """How one tower call divides: ``units[i]`` input rows of item ``i`` (patches, views),
    ``costs[i]`` its FLOPs, ``call(lo, hi)`` the tower's arguments for items ``[lo, hi)``,
    ``dummy()`` the arguments of a smallest call (``dummy_units`` input rows) for a rank with no
    item, and ``keep(out)`` the output with the fields the caller does not read set to None
    (not gathered)."""

    units: list[int]
    costs: list[float]
    call: Callable[[int, int], Call]
    dummy: Callable[[], Call]
    dummy_units: int
    keep: Callable[[Any], Any] = lambda out: out


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


def _map(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``out`` with ``fn`` applied to every tensor (ModelOutput, tuple, list; None kept)."""
    if out is None:
        return None
    if torch.is_tensor(out):
        return fn(out)
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):  # transformers' ModelOutput
        return type(out)(**{k: _map(v, fn) for k, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(_map(v, fn) for v in out)
    raise TypeError(f"cannot gather a vision output of type {type(out).__name__}")


class SplitVision:
    """Hooks on ``spec.vision_tower(model)`` that split each call over the SP ``group``.

    ``SplitVision(spec, model, group).install()`` before the forward (and before hooks that
    derive tower inputs from the grid, such as the Qwen-VL ``media_context``: they then see the
    rank's sub-grid); ``remove()`` undoes it. With one rank it does nothing. ``last_costs``:
    the FLOPs of each rank's share in the last call (for metrics and benchmarks).
    """

    def __init__(self, spec: Any, model: nn.Module, group: Any) -> None:
        import torch.distributed as dist

        self.spec, self.model, self.group = spec, model, group
        self.sp = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.tower = spec.vision_tower(model)
        self._handles: list[Any] = []
        self._ctx: tuple[VisionSplitPlan, list[int], bool] | None = None
        self.last_costs: list[float] = []

    def install(self) -> SplitVision:
        if self._handles:
            raise RuntimeError("SplitVision is already installed")
        if self.sp > 1 and self.tower is not None:
            self._handles = [
                self.tower.register_forward_pre_hook(self._pre, with_kwargs=True),
                self.tower.register_forward_hook(self._post),
            ]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> SplitVision:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _pre(self, _mod: nn.Module, args: tuple, kwargs: dict) -> Call:
        from lmms_parallel import split_contiguous

        plan = self.spec.vision_split_plan(self.model, args, kwargs)
        ranges = split_contiguous(plan.costs, self.sp)
        counts = [sum(plan.units[lo:hi]) for lo, hi in ranges]
        self.last_costs = [sum(plan.costs[lo:hi]) for lo, hi in ranges]
        lo, hi = ranges[self.rank]
        empty = lo == hi
        self._ctx = (plan, counts, empty)
        return plan.dummy() if empty else plan.call(lo, hi)

    def _post(self, _mod: nn.Module, _args: Any, out: Any) -> Any:
        from lmms_parallel import gather_rows

        if self._ctx is None:
            raise RuntimeError("SplitVision: the tower's output came without its input hook")
        plan, counts, empty = self._ctx
        self._ctx = None
        local = plan.dummy_units if empty else counts[self.rank]

        def gather(t: torch.Tensor) -> torch.Tensor:
            per_unit = Fraction(t.shape[0], local)
            rows = [u * per_unit for u in counts]
            if any(r.denominator != 1 for r in rows):
                raise ValueError(
                    f"a vision output of {t.shape[0]} rows for {local} input rows does not "
                    f"divide into the ranks' shares {counts}"
                )
            mine = t[:0] if empty else t
            return gather_rows(mine, [int(r) for r in rows], self.group)

        return _map(plan.keep(out), gather)
