"""Hooks that split each call of a vision tower over the ranks of a Ulysses SP group.

Every rank of an SP group holds the same pack. :class:`SplitVision` hooks the tower: each call
is cut into *items* (what the tower encodes independently: an image, a video's temporal patch,
an anyres view), the items are shared out in contiguous ranges balanced by their FLOPs
(:func:`split_contiguous`), each rank runs the tower on its range only, and the outputs are
all-gathered in pack order (:func:`gather_rows`), so whatever reads the tower's output (the
multimodal merge, deepstack, the Ulysses slicing) runs exactly as without the split. Gradients:
each rank's rows receive the sum of every rank's gradient for them, so the tower's parameter
gradients equal the unsplit run's (FSDP sums them over the group as for the decoder). A rank
whose range is empty runs the tower on the model's dummy input and contributes zero rows, which
keeps FSDP's collectives in step.

Model-agnostic: the model side states, per tower call, a :class:`VisionSplitPlan` (items, their
costs, how to call the tower on a range of them); lmms-models' families do so in
``ModelSpec.vision_split_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from ._ulysses import _size_rank
from ._vision_split import gather_rows, split_contiguous

__all__ = ["SplitVision", "VisionSplitPlan"]

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
    """Hooks on ``tower`` that split each of its calls over the SP ``group``.

    ``plan(args, kwargs)`` gives the :class:`VisionSplitPlan` of one call's arguments.
    ``SplitVision(tower, plan, group).install()`` before the forward (and before hooks that
    derive tower inputs from the call's arguments: they then see the rank's share);
    ``remove()`` undoes it; also a context manager. With one rank (or no tower) it does
    nothing. ``last_costs``: the FLOPs of each rank's share in the last call (for metrics and
    benchmarks).
    """

    def __init__(
        self,
        tower: nn.Module | None,
        plan: Callable[[tuple, dict[str, Any]], VisionSplitPlan],
        group: Any,
    ) -> None:
        self.tower, self.plan, self.group = tower, plan, group
        self.sp, self.rank = _size_rank(group)
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
        plan = self.plan(args, kwargs)
        ranges = split_contiguous(plan.costs, self.sp)
        counts = [sum(plan.units[lo:hi]) for lo, hi in ranges]
        self.last_costs = [sum(plan.costs[lo:hi]) for lo, hi in ranges]
        lo, hi = ranges[self.rank]
        empty = lo == hi
        self._ctx = (plan, counts, empty)
        return plan.dummy() if empty else plan.call(lo, hi)

    def _post(self, _mod: nn.Module, _args: Any, out: Any) -> Any:
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
