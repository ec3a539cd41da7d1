"""Streaming bin packing over any iterable, with exact resume.

Memory is bounded by the open bins (at most ``max_open_bins`` lists of items), never by the
stream. The hot loops below use plain Python ints and lists on purpose: one numpy call per item
costs more than the whole placement (measured in benchmarks/pack/bench_pack.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

from lmms_pack._collate import truncate_sample

T = TypeVar("T")

STREAM_STRATEGIES = ("first_fit", "best_fit", "next_fit")
OVERLONG_POLICIES = ("error", "skip", "truncate")
_STATE_VERSION = 1


@dataclass(slots=True)
class PackStats:
    """Counters of a packer; ``fill_ratio`` is over the packs emitted so far."""

    capacity: int
    budget_capacity: int | None = None
    packs: int = 0  # packs emitted
    items: int = 0  # items in emitted packs (truncated ones included)
    tokens: int = 0  # tokens in emitted packs
    budget: int = 0  # second-budget units in emitted packs (0 without a budget)
    skipped: int = 0  # items left out under overlong="skip" (or over the second budget)
    truncated: int = 0  # items cut to `capacity` under overlong="truncate"

    @property
    def fill_ratio(self) -> float:
        """Tokens emitted / (packs emitted x capacity); 0.0 before the first pack."""
        return self.tokens / (self.packs * self.capacity) if self.packs else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["fill_ratio"] = self.fill_ratio
        return out


def _truncate_length(item: int, capacity: int) -> int:
    return capacity


def _truncate_sample(item: Any, capacity: int) -> Any:
    if isinstance(item, Mapping) and "input_ids" in item:
        return truncate_sample(item, capacity)
    raise TypeError(
        f"overlong='truncate' cannot cut an item of type {type(item).__name__}: pass "
        "truncate_fn=callable(item, capacity) -> item to StreamPacker"
    )


def _as_int(x: Any, what: str, index: int) -> int:
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"item {index}: {what} must be an int, got {x!r}") from None


class StreamPacker(Generic[T]):
    """Pack a stream of items into packs of at most ``capacity`` tokens.

    Strategies (``max_open_bins`` bins are kept open; memory never grows with the stream):

    - ``first_fit``: each item goes to the earliest-opened open bin it fits in. When it fits in
      none and all bins are open, the fullest bin is emitted (ties: the earliest opened) and a
      new bin is opened with the item.
    - ``best_fit``: the tightest open bin (least room left that still fits; ties: earliest).
    - ``next_fit``: one open bin (``max_open_bins`` does not apply); what other engines ship
      under the name "first_fit".

    A bin that becomes exactly full is emitted at once; an item of exactly ``capacity`` tokens
    is emitted alone without touching the open bins. At the end of the stream the open bins are
    emitted in the order they were opened (unless ``pack(..., flush=False)``).

    Second budget: with ``budget_capacity=N`` and ``pack(..., budget=callable)``, no pack holds
    more than N budget units (e.g. vision tokens or images), so vision-encoder cost is spread
    over packs. An item fits a bin only if both its tokens and its budget fit.

    Items longer than ``capacity`` (``overlong``): ``"error"`` raises ``ValueError`` naming the
    item's stream index and length; ``"skip"`` leaves it out and counts it in
    ``stats.skipped``; ``"truncate"`` replaces it by ``truncate_fn(item, capacity)`` (default:
    with ``length=None`` the int becomes ``capacity``; sample dicts go through
    :func:`lmms_pack.truncate_sample`) and counts it in ``stats.truncated``. An item whose
    budget alone exceeds ``budget_capacity`` raises under ``"error"`` and is skipped (counted)
    otherwise. Lengths must be ints >= 1.

    Resume protocol (exact): ``pack()`` pulls items lazily, one at a time, and before it yields
    a pack it has placed every item pulled so far. So between two yielded packs,
    ``state_dict()`` holds the open bins (their items, stored as given) and ``consumed``, the
    number of items pulled from the stream(s) so far (over all ``pack()`` calls). To resume:
    build a packer with the same arguments, ``load_state_dict(state)``, and call ``pack()`` on
    the stream starting at position ``state["consumed"]``; it yields exactly the packs the
    uninterrupted packer would have yielded after that point. The state is plain data (dicts,
    lists, ints, strings and the items themselves), so it is JSON-serialisable when the items
    are. One ``pack()`` iterator per packer at a time; ``load_state_dict`` only while none is
    running.
    """

    def __init__(
        self,
        capacity: int,
        strategy: str = "first_fit",
        max_open_bins: int = 8,
        overlong: str = "error",
        *,
        budget_capacity: int | None = None,
        truncate_fn: Callable[[T, int], T] | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if strategy not in STREAM_STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {STREAM_STRATEGIES}")
        if not isinstance(max_open_bins, int) or max_open_bins < 1:
            raise ValueError(f"max_open_bins must be an int >= 1, got {max_open_bins!r}")
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(
                f"unknown overlong policy {overlong!r}; choose one of {OVERLONG_POLICIES}"
            )
        if budget_capacity is not None and (
            not isinstance(budget_capacity, int) or budget_capacity < 0
        ):
            raise ValueError(f"budget_capacity must be an int >= 0, got {budget_capacity!r}")
        self.capacity = capacity
        self.strategy = strategy
        self.max_open_bins = 1 if strategy == "next_fit" else max_open_bins
        self.overlong = overlong
        self.budget_capacity = budget_capacity
        self.truncate_fn = truncate_fn
        self.stats = PackStats(capacity, budget_capacity)
        self._bins: list[list[T]] = []  # open bins, in the order they were opened
        self._rem: list[int] = []  # tokens left in each open bin
        self._brem: list[int] = []  # budget left in each open bin (with budget_capacity only)
        self._active = False

    # ------------------------------------------------------------------ public API
    @property
    def consumed(self) -> int:
        """Items pulled from the stream(s) so far: emitted + skipped + waiting in open bins."""
        return self.stats.items + self.stats.skipped + sum(len(b) for b in self._bins)

    @property
    def open_bins(self) -> int:
        return len(self._bins)

    def pack(
        self,
        items: Iterable[T],
        length: Callable[[T], int] | None = None,
        *,
        budget: Callable[[T], int] | None = None,
        flush: bool = True,
    ) -> Iterator[list[T]]:
        """Yield packs (lists of items, in placement order) while consuming ``items`` lazily.

        ``length(item)`` gives an item's tokens; ``None`` means the items are int lengths
        themselves. ``budget(item)`` gives its second-budget units (needs ``budget_capacity``).
        ``flush=False`` keeps the open bins at the end of the stream for the next ``pack()``
        call (e.g. the next epoch) instead of emitting them.
        """
        if (budget is None) != (self.budget_capacity is None):
            raise ValueError("pass budget=callable to pack() exactly when budget_capacity is set")
        return self._run(items, int if length is None else length, budget, flush)

    def state_dict(self) -> dict[str, Any]:
        """Plain-data snapshot: config, open bins (items as given), counters, ``consumed``."""
        cap, bcap = self.capacity, self.budget_capacity
        bins = []
        for i, b in enumerate(self._bins):
            entry: dict[str, Any] = {"items": list(b), "tokens": int(cap - self._rem[i])}
            if bcap is not None:
                entry["budget"] = int(bcap - self._brem[i])
            bins.append(entry)
        stats = {f.name: getattr(self.stats, f.name) for f in fields(self.stats)}
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "bins": bins,
            "stats": {k: (v if v is None else int(v)) for k, v in stats.items()},
            "consumed": int(self.consumed),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the packer must have been built with the same config."""
        if self._active:
            raise RuntimeError(
                "load_state_dict() while a pack() iterator of this packer is running"
            )
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported packer state version {state.get('version')!r}")
        mine, theirs = self._config(), dict(state["config"])
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            raise ValueError(f"packer state was saved with a different config (saved, now): {diff}")
        cap, bcap = self.capacity, self.budget_capacity
        self._bins = [list(b["items"]) for b in state["bins"]]
        self._rem = [cap - int(b["tokens"]) for b in state["bins"]]
        self._brem = [] if bcap is None else [bcap - int(b["budget"]) for b in state["bins"]]
        self.stats = PackStats(**state["stats"])
        if self.consumed != state["consumed"]:
            raise ValueError(
                f"inconsistent packer state: consumed={state['consumed']} but counters give {self.consumed}"
            )

    # ------------------------------------------------------------------ internals
    def _config(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "strategy": self.strategy,
            "max_open_bins": self.max_open_bins,
            "overlong": self.overlong,
            "budget_capacity": self.budget_capacity,
        }

    def _run(self, items, length, budget, flush) -> Iterator[list[T]]:
        if self._active:
            raise RuntimeError("another pack() iterator of this packer is still running")
        self._active = True
        try:
            if budget is not None:
                yield from self._loop_budget(iter(items), length, budget)
            else:
                yield from self._loop(iter(items), length)
            if flush:
                while self._bins:
                    b = self._bins.pop(0)
                    r = self._rem.pop(0)
                    rb = self._brem.pop(0) if self._brem else None
                    self._emitted(
                        b, self.capacity - r, 0 if rb is None else self.budget_capacity - rb
                    )
                    yield b
        finally:
            self._active = False

    def _emitted(self, b: list[T], tokens: int, budget: int = 0) -> None:
        st = self.stats
        st.packs += 1
        st.items += len(b)
        st.tokens += tokens
        st.budget += budget

    def _irregular(self, item, n, b, length, budget):
        """Item with length outside [1, capacity) or budget over budget_capacity.

        Returns (item, length, budget) to place; length == capacity means "emit alone",
        length 0 means "skipped"."""
        cap, bcap = self.capacity, self.budget_capacity
        n, b = _as_int(n, "length", self.consumed), _as_int(b, "budget", self.consumed)
        if n < 1:
            raise ValueError(f"item {self.consumed}: length must be >= 1, got {n}")
        if b < 0:
            raise ValueError(f"item {self.consumed}: budget must be >= 0, got {b}")
        over_budget = bcap is not None and b > bcap
        if n <= cap and not over_budget:
            return item, n, b
        what = f"length {n} > capacity {cap}" if n > cap else f"budget {b} > budget_capacity {bcap}"
        if self.overlong == "error":
            raise ValueError(
                f"item {self.consumed} is overlong: {what} (overlong='error'; use 'skip' or 'truncate')"
            )
        if self.overlong == "truncate" and n > cap:
            cut = self.truncate_fn or (_truncate_length if length is int else _truncate_sample)
            item = cut(item, cap)
            n = _as_int(length(item), "length", self.consumed)
            if not 1 <= n <= cap:
                raise ValueError(f"truncate_fn returned an item of length {n}, not in [1, {cap}]")
            b = _as_int(budget(item), "budget", self.consumed) if budget is not None else 0
            if bcap is None or b <= bcap:
                self.stats.truncated += 1
                return item, n, b
        self.stats.skipped += 1
        return item, 0, 0

    def _loop(self, items: Iterator[T], length: Callable[[T], int]) -> Iterator[list[T]]:
        """first_fit and best_fit (next_fit is first fit over one open bin), no budget."""
        cap, maxb = self.capacity, self.max_open_bins
        bins, rem = self._bins, self._rem
        best_fit = self.strategy == "best_fit"
        emitted = self._emitted
        for item in items:
            n = length(item)
            if not 0 < n < cap:
                item, n, _ = self._irregular(item, n, 0, length, None)
                if n == cap:
                    b = [item]
                    emitted(b, cap)
                    yield b
                    continue
                if not n:
                    continue
            if best_fit:  # least room left that still fits; ties keep the earliest
                i = found = -1
                least = cap  # every open bin has < cap tokens left
                for r in rem:
                    i += 1
                    if n <= r < least:
                        found, least = i, r
            else:  # first fit: earliest-opened bin with room
                found = 0
                for r in rem:
                    if r >= n:
                        break
                    found += 1
                else:
                    found = -1
            if found < 0:  # fits nowhere: open a new bin, evicting the fullest when all are open
                if len(rem) < maxb:
                    bins.append([item])
                    rem.append(cap - n)
                    continue
                j = rem.index(min(rem))
                b = bins.pop(j)
                r = rem.pop(j)
                bins.append([item])
                rem.append(cap - n)
                emitted(b, cap - r)
                yield b
                continue
            r = rem[found] - n
            if r:
                rem[found] = r
                bins[found].append(item)
            else:  # exactly full
                b = bins.pop(found)
                del rem[found]
                b.append(item)
                emitted(b, cap)
                yield b

    def _loop_budget(self, items, length, budget) -> Iterator[list[T]]:
        """All strategies with a second budget (slower: two checks per bin)."""
        cap, bcap, maxb = self.capacity, self.budget_capacity, self.max_open_bins
        bins, rem, brem = self._bins, self._rem, self._brem
        best_fit = self.strategy == "best_fit"
        emitted = self._emitted
        for item in items:
            n = length(item)
            nb = budget(item)
            if not 0 < n < cap or not 0 <= nb <= bcap:
                item, n, nb = self._irregular(item, n, nb, length, budget)
                if n == cap:
                    b = [item]
                    emitted(b, cap, nb)
                    yield b
                    continue
                if not n:
                    continue
            found, least = -1, cap
            for i, r in enumerate(rem):
                if n <= r < least and brem[i] >= nb:
                    found, least = i, r
                    if not best_fit:
                        break
            if found < 0:
                if len(rem) >= maxb:
                    j = rem.index(min(rem))
                    b = bins.pop(j)
                    r = rem.pop(j)
                    rb = brem.pop(j)
                    bins.append([item])
                    rem.append(cap - n)
                    brem.append(bcap - nb)
                    emitted(b, cap - r, bcap - rb)
                    yield b
                else:
                    bins.append([item])
                    rem.append(cap - n)
                    brem.append(bcap - nb)
                continue
            r = least - n
            if r:
                rem[found] = r
                brem[found] -= nb
                bins[found].append(item)
            else:
                b = bins.pop(found)
                del rem[found]
                rb = brem.pop(found) - nb
                b.append(item)
                emitted(b, cap, bcap - rb)
                yield b
