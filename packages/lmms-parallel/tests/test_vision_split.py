"""split_contiguous: the optimal contiguous min-max partition (against brute force), no empty
share while items suffice; split_imbalance."""

from __future__ import annotations

import itertools
import random

import pytest

from lmms_parallel import split_contiguous, split_imbalance


def _brute(costs, parts):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    n, parts = rng.randint(0, 9), rng.randint(1, 5)
    costs = [rng.choice([1.0, 2.0, 5.0, 16.0, 0.5]) * rng.randint(1, 4) for _ in range(n)]
    ranges = split_contiguous(costs, parts)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, in order
    got = max(sum(costs[lo:hi]) for lo, hi in ranges)
    if n:
        assert got == pytest.approx(_brute(costs, parts))
    empty = sum(lo == hi for lo, hi in ranges)
    assert empty == max(0, parts - n)
    assert all(hi == 0 for lo, hi in ranges[:empty])  # empty shares on the first ranks


def test_flops_not_counts():
    # one big image and eight small frames: the big one alone on a rank, the frames on the other
    costs = [8.0] + [1.0] * 8
    assert split_contiguous(costs, 2) == [(0, 1), (1, 9)]
    assert split_imbalance(costs, [(0, 1), (1, 9)]) == pytest.approx(1.0)
    assert split_imbalance(costs, [(0, 5), (5, 9)]) == pytest.approx(12 / 8)
    with pytest.raises(ValueError, match="parts"):
        split_contiguous(costs, 0)
