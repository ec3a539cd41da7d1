"""Offline packing of a known list of lengths: FFD/BFD, or a streaming strategy in order.

First fit decreasing uses a max segment tree over bins (leftmost bin with room in O(log B));
best fit decreasing indexes open bins by tokens left (a two-level bitset finds the tightest in
a few word operations). Both are exact: they give the bins the textbook O(n * B) loops give,
with the tie rules stated in :func:`pack_lengths`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from lmms_pack._stream import OVERLONG_POLICIES, STREAM_STRATEGIES, PackStats, StreamPacker

OFFLINE_STRATEGIES = ("ffd", "bfd")
STRATEGIES = STREAM_STRATEGIES + OFFLINE_STRATEGIES


class PackResult(list[list[int]]):
    """The packs (lists of indices into ``lengths``) plus the packer's :class:`PackStats`."""

    stats: PackStats


def _as_int_list(values, name: str) -> list[int]:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise TypeError(
            f"{name} must be a 1-D sequence of ints, got dtype {arr.dtype} shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False).tolist()


def pack_lengths(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    strategy: str = "ffd",
    *,
    max_open_bins: int = 8,
    overlong: str = "error",
    budgets: Sequence[int] | np.ndarray | None = None,
    budget_capacity: int | None = None,
) -> PackResult:
    """Pack items of known ``lengths`` into packs of at most ``capacity`` tokens.

    Returns a list of packs, each a list of indices into ``lengths`` (``.stats`` holds the
    counters). Strategies:

    - ``ffd`` / ``bfd``: first / best fit decreasing. Items are sorted by length, longest first
      (stable: equal lengths keep their input order), then each goes to the earliest-opened
      bin with room (ffd) or to the bin with the least room that still fits (bfd; ties: the
      earliest opened); a new bin is opened when none fits. Packs come in the order their bins
      were opened, indices in placement order.
    - ``first_fit`` / ``best_fit`` / ``next_fit``: the streaming :class:`StreamPacker` over the
      items in input order with ``max_open_bins``; packs come in emission order.

    ``budgets`` with ``budget_capacity`` adds the second per-pack budget. Overlong items
    follow ``overlong`` as in :class:`StreamPacker`; under ``"truncate"`` the index is packed
    alone as ``capacity`` tokens (the caller cuts the sample); counted in ``.stats``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"unknown overlong policy {overlong!r}; choose one of {OVERLONG_POLICIES}")
    if (budgets is None) != (budget_capacity is None):
        raise ValueError("pass budgets exactly when budget_capacity is set")
    lens = _as_int_list(lengths, "lengths")
    buds = None if budgets is None else _as_int_list(budgets, "budgets")
    if buds is not None and len(buds) != len(lens):
        raise ValueError(f"{len(buds)} budgets for {len(lens)} lengths")
    stats = PackStats(capacity, budget_capacity)
    keep = _screen(lens, buds, capacity, budget_capacity, overlong, stats)  # may cut lens

    if strategy in STREAM_STRATEGIES:
        packer = StreamPacker(
            capacity, strategy, max_open_bins, "error", budget_capacity=budget_capacity
        )
        budget = None if buds is None else buds.__getitem__
        result = PackResult(packer.pack(keep, length=lens.__getitem__, budget=budget))
        packer.stats.skipped, packer.stats.truncated = stats.skipped, stats.truncated
        result.stats = packer.stats
        return result

    idx = np.asarray(keep, dtype=np.int64)
    # Longest first; stable, so equal lengths keep their input order.
    order = idx[np.argsort(-np.asarray(lens, dtype=np.int64)[idx], kind="stable")].tolist()
    if strategy == "ffd":
        result = PackResult(_first_fit_decreasing(order, lens, capacity, buds, budget_capacity))
    else:
        result = PackResult(_best_fit_decreasing(order, lens, capacity, buds, budget_capacity))
    stats.packs, stats.items = len(result), len(keep)
    stats.tokens = sum(lens[i] for i in keep)
    stats.budget = 0 if buds is None else sum(buds[i] for i in keep)
    result.stats = stats
    return result


def _screen(
    lens: list[int],
    buds: list[int] | None,
    cap: int,
    bcap: int | None,
    overlong: str,
    stats: PackStats,
) -> range | list[int]:
    """Apply the overlong policy; returns the indices to pack (``lens`` cut in place)."""
    arr = np.asarray(lens, dtype=np.int64)
    bad = (arr < 1) | (arr > cap)
    if buds is not None:
        barr = np.asarray(buds, dtype=np.int64)
        bad |= (barr < 0) | (barr > bcap)
    if not bad.any():
        return range(len(lens))
    drop = set()
    for i in np.flatnonzero(bad).tolist():
        n, nb = lens[i], 0 if buds is None else buds[i]
        if n < 1 or nb < 0:
            raise ValueError(f"item {i}: length must be >= 1 and budget >= 0, got {n} and {nb}")
        what = (
            f"length {n} > capacity {cap}" if n > cap else f"budget {nb} > budget_capacity {bcap}"
        )
        if overlong == "error":
            raise ValueError(
                f"item {i} is overlong: {what} (overlong='error'; use 'skip' or 'truncate')"
            )
        if overlong == "truncate" and n > cap and (bcap is None or nb <= bcap):
            lens[i] = cap  # packed alone; the caller cuts the sample
            stats.truncated += 1
        else:
            drop.add(i)
            stats.skipped += 1
    return [i for i in range(len(lens)) if i not in drop] if drop else range(len(lens))


def _first_fit_decreasing(order, lens, cap, buds, bcap) -> list[list[int]]:
    """Leftmost bin with room, via a max segment tree over bins (virtual empty bins at cap)."""
    # Any two first-fit bins hold > cap together, so bins <= 2 * total / cap + 1 (no budget).
    bound = (
        len(order)
        if buds is not None
        else min(len(order), 2 * sum(lens[i] for i in order) // cap + 2)
    )
    size = 1
    while size < max(1, bound):
        size *= 2
    tree = [cap] * (2 * size)
    btree = [bcap] * (2 * size) if buds is not None else None
    bins: list[list[int]] = []
    for idx in order:
        n = lens[idx]
        if btree is None:
            if tree[1] < n:
                raise AssertionError("first-fit bin bound exceeded")  # pragma: no cover
            i = 1
            while i < size:  # descend to the leftmost leaf with >= n left
                i *= 2
                if tree[i] < n:
                    i += 1
        else:
            i = _leftmost_both(tree, btree, size, n, buds[idx])
        leaf = i - size
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(idx)
        tree[i] -= n
        if btree is not None:
            btree[i] -= buds[idx]
        i //= 2
        while i:  # refresh the maxima above the leaf
            a, b = tree[2 * i], tree[2 * i + 1]
            m = a if a > b else b
            if btree is None:
                if tree[i] == m:
                    break
                tree[i] = m
            else:
                a, b = btree[2 * i], btree[2 * i + 1]
                tree[i], btree[i] = m, (a if a > b else b)
            i //= 2
    return bins


def _leftmost_both(tree, btree, size, n, nb) -> int:
    """Leftmost leaf with >= n tokens and >= nb budget left (depth-first, pruned by maxima)."""
    stack = [1]
    while stack:
        i = stack.pop()
        if tree[i] < n or btree[i] < nb:
            continue
        if i >= size:
            return i
        stack.append(2 * i + 1)
        stack.append(2 * i)
    raise AssertionError("a fresh bin always has room")  # pragma: no cover


def _best_fit_decreasing(order, lens, cap, buds, bcap) -> list[list[int]]:
    """Tightest bin: bins bucketed by tokens left; a two-level bitset finds the next bucket."""
    nwords = cap // 64 + 1
    words = [0] * nwords  # bit r set <=> some open bin has exactly r tokens left
    summary = 0  # bit w set <=> words[w] != 0
    buckets: list[list[int] | None] = [None] * cap  # r -> open bin ids with r left, ascending
    bins: list[list[int]] = []
    brem: list[int] = []
    for idx in order:
        n = lens[idx]
        nb = 0 if buds is None else buds[idx]
        r, b = n, -1
        while True:  # smallest r' >= r with a non-empty bucket
            w = r >> 6
            m = words[w] >> (r & 63) if w < nwords else 0
            if m:
                r += (m & -m).bit_length() - 1
            else:
                s = summary >> (w + 1)
                if not s:
                    break
                w += (s & -s).bit_length()
                m = words[w]
                r = (w << 6) + (m & -m).bit_length() - 1
            bucket = buckets[r]
            if buds is None:
                b = bucket[0]
                break
            b = next((x for x in bucket if brem[x] >= nb), -1)
            if b >= 0:
                break
            r += 1
        if b < 0:
            b = len(bins)
            bins.append([idx])
            brem.append(0 if buds is None else bcap - nb)
            left = cap - n
        else:
            bins[b].append(idx)
            if buds is not None:
                brem[b] -= nb
            bucket = buckets[r]
            bucket.remove(b)
            if not bucket:
                buckets[r] = None
                words[r >> 6] &= ~(1 << (r & 63))
                if not words[r >> 6]:
                    summary &= ~(1 << (r >> 6))
            left = r - n
        if left:
            bucket = buckets[left]
            if bucket is None:
                buckets[left] = [b]
                words[left >> 6] |= 1 << (left & 63)
                summary |= 1 << (left >> 6)
            else:
                bisect.insort(bucket, b)
    return bins
