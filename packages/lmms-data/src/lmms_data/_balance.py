"""Vision-FLOPs balancing of packs across data-parallel ranks, with no communication.

Each DP rank's loader keeps a look-ahead window of ``window`` packs and, at step ``s``, emits the
pack at the ``u_s`` quantile of its window's vision costs, where ``u_s = frac((s + 1) * phi)``
(phi = the golden ratio's conjugate, a low-discrepancy sequence over [0, 1)) is the same on every
rank. Ranks draw from statistically alike streams, so the ``u`` quantile of each window is about
the stream's ``u`` quantile: at each step all ranks emit packs of similar vision cost (the heavy
ones together, the light ones together) instead of a heavy pack next to a text-only one, which
lowers max/mean vision FLOPs over the ranks of a step. Because ``u_s`` sweeps [0, 1) evenly,
packs are drawn from the whole cost range in proportion; a pack that has waited ``max_age`` steps
is emitted first, so none waits longer and every pack is emitted once.

The choice depends only on the window's costs, the step and the packs' ages, so a saved
:meth:`VisionBalancer.state_dict` (step, and for the packs still in the window their offsets and
arrival steps) together with the loader's stream states at the window's first pack reproduces the
same sequence on resume (see ``PackedLoader``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

PHI = (math.sqrt(5) - 1) / 2


def default_vision_cost(batch: dict[str, Any]) -> float:
    """A model-free vision cost of a pack: the patches of its image and video grids (``t*h*w``
    per row of ``image_grid_thw`` / ``video_grid_thw``), else the rows of ``pixel_values`` /
    ``pixel_values_videos`` (tiles or frames). The trainer passes its family's exact
    ``pack_vision_flops`` instead."""
    total = 0.0
    for grid_key, px_key in (("image_grid_thw", "pixel_values"), ("video_grid_thw", "pixel_values_videos")):  # fmt: skip
        grid, px = batch.get(grid_key), batch.get(px_key)
        if grid is not None and len(grid):
            total += float(np.asarray(grid).prod(-1).sum())
        elif px is not None:
            total += float(len(px))
    return total


def quantile_target(step: int) -> float:
    """``u_s`` in [0, 1): the quantile every rank emits at ``step``."""
    return ((step + 1) * PHI) % 1.0


@dataclass(kw_only=True, slots=True)
class _Entry:
    offset: int  # position in the produced sequence since the window's base
    item: Any  # what the loader emits, and what it needs to advance its base
    cost: float
    born: int  # step at arrival
    done: bool = False


class VisionBalancer:
    """The look-ahead window and the pick rule; the loader feeds produced packs with
    :meth:`push` and emits what :meth:`pop` returns (``None``: feed more)."""

    def __init__(
        self, window: int, cost: Callable[[dict[str, Any]], float] | None = None,
        max_age: int | None = None,
    ) -> None:  # fmt: skip
        if window < 2:
            raise ValueError(f"vision balancing needs a window of at least 2 packs, got {window}")
        self.window, self.cost = window, cost or default_vision_cost
        self.max_age = 4 * window if max_age is None else max_age
        self.step = 0
        self.entries: list[_Entry] = []
        self._next_offset = 0
        self._restore: dict[int, int | None] = {}  # offset -> born (None: emitted before the save)

    # ---- feeding and picking ----------------------------------------------------------------
    def push(self, batch: dict[str, Any], item: Any) -> None:
        off = self._next_offset
        self._next_offset += 1
        e = _Entry(offset=off, item=item, cost=float(self.cost(batch)), born=self.step)
        if off in self._restore:  # re-produced after a resume: its saved arrival, or emitted
            born = self._restore.pop(off)
            e.done, e.born = born is None, e.born if born is None else born
        self.entries.append(e)

    def pending(self) -> int:
        return sum(not e.done for e in self.entries)

    def pop(self, *, draining: bool = False) -> _Entry | None:
        """The next pack to emit once the window is full (or the source ended), else None."""
        live = [e for e in self.entries if not e.done]
        if not live or (len(live) < self.window and not draining) or self._restore:
            return None
        e = self.pick(live)
        e.done = True
        self.step += 1
        return e

    def pick(self, live: list[_Entry]) -> _Entry:
        """The oldest pack once it waited ``max_age`` steps, else the ``u_s`` quantile by cost."""
        oldest = min(live, key=lambda e: e.born)
        if self.step - oldest.born >= self.max_age:
            return oldest
        order = sorted(live, key=lambda e: (e.cost, e.offset))
        return order[min(len(order) - 1, int(quantile_target(self.step) * len(order)))]

    def advance(self) -> list[_Entry]:
        """Drop the emitted packs at the window's head (the loader's saved base moves past
        them); returns them in produced order."""
        gone = []
        while self.entries and self.entries[0].done:
            gone.append(self.entries.pop(0))
        return gone

    # ---- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Offsets are relative to the window's first pack (the loader saves the streams as they
        were just before it)."""
        # packs not re-produced yet since a load: nothing was emitted since, so the base is 0
        base = 0 if self._restore or not self.entries else self.entries[0].offset
        win = [[e.offset - base, None if e.done else e.born] for e in self.entries]
        restore = [[o, b] for o, b in self._restore.items()]
        return {"size": self.window, "step": self.step, "window": win + restore}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.window:
            raise ValueError(
                f"data state saved with vision_balance_window {state['size']}, the loader has "
                f"{self.window}: resume with the same setting"
            )
        self.step = int(state["step"])
        self.entries, self._next_offset = [], 0
        self._restore = {int(o): (None if b is None else int(b)) for o, b in state["window"]}
