"""pack_lengths: FFD/BFD against naive references; overlong policies; budgets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmms_pack import STRATEGIES, pack_lengths

SETTINGS = settings(max_examples=200, deadline=None)


def reference_decreasing(lengths, cap, best, budgets=None, bcap=0):
    """Textbook FFD / BFD over all bins (O(n * B)), stable sort, ties to the earliest bin."""
    budgets = budgets or [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins = []  # [indices, tokens, budget]
    for i in order:
        fits = [
            k
            for k, (_, t, u) in enumerate(bins)
            if t + lengths[i] <= cap and u + budgets[i] <= bcap
        ]
        if not fits:
            bins.append([[i], lengths[i], budgets[i]])
            continue
        k = min(fits, key=lambda k: (cap - bins[k][1], k)) if best else fits[0]
        bins[k][0].append(i)
        bins[k][1] += lengths[i]
        bins[k][2] += budgets[i]
    return [b[0] for b in bins]


@st.composite
def cases(draw, budget=False):
    cap = draw(st.integers(1, 200))
    lengths = draw(st.lists(st.integers(1, cap), max_size=120))
    if not budget:
        return cap, lengths, None, None
    bcap = draw(st.integers(0, 6))
    budgets = draw(st.lists(st.integers(0, bcap), min_size=len(lengths), max_size=len(lengths)))
    return cap, lengths, budgets, bcap


@SETTINGS
@given(cases(), st.sampled_from(["ffd", "bfd"]))
def test_decreasing_matches_reference(case, strategy):
    cap, lengths, _, _ = case
    packs = pack_lengths(lengths, cap, strategy)
    assert packs == reference_decreasing(lengths, cap, strategy == "bfd")
    assert packs.stats.tokens == sum(lengths) and packs.stats.packs == len(packs)


@SETTINGS
@given(cases(budget=True), st.sampled_from(["ffd", "bfd"]))
def test_decreasing_with_budget_matches_reference(case, strategy):
    cap, lengths, budgets, bcap = case
    packs = pack_lengths(lengths, cap, strategy, budgets=budgets, budget_capacity=bcap)
    assert packs == reference_decreasing(lengths, cap, strategy == "bfd", budgets, bcap)


@SETTINGS
@given(cases(budget=True), st.sampled_from(STRATEGIES), st.integers(1, 5))
def test_every_index_once_within_capacity_and_budget(case, strategy, maxb):
    cap, lengths, budgets, bcap = case
    packs = pack_lengths(
        lengths, cap, strategy, max_open_bins=maxb, budgets=budgets, budget_capacity=bcap
    )
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(
        sum(lengths[i] for i in p) <= cap and sum(budgets[i] for i in p) <= bcap for p in packs
    )
    assert packs == pack_lengths(
        lengths, cap, strategy, max_open_bins=maxb, budgets=budgets, budget_capacity=bcap
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overlong_policies(strategy):
    lengths = np.array([5, 30, 7, 10, 12, 3])
    with pytest.raises(ValueError, match=r"item 1 is overlong: length 30 > capacity 10"):
        pack_lengths(lengths, 10, strategy)
    skipped = pack_lengths(lengths, 10, strategy, overlong="skip")
    assert sorted(i for p in skipped for i in p) == [0, 2, 3, 5]
    assert skipped.stats.skipped == 2 and skipped.stats.items == 4
    cut = pack_lengths(lengths, 10, strategy, overlong="truncate")
    assert sorted(i for p in cut for i in p) == list(range(6))
    assert [1] in cut and [4] in cut and [3] in cut  # truncated items fill a pack alone
    assert cut.stats.truncated == 2 and cut.stats.tokens == 5 + 10 + 7 + 10 + 10 + 3


def test_over_budget_and_bad_input():
    with pytest.raises(ValueError, match=r"item 1 is overlong: budget 9 > budget_capacity 4"):
        pack_lengths([3, 3], 10, budgets=[1, 9], budget_capacity=4)
    packs = pack_lengths([3, 3], 10, "bfd", overlong="truncate", budgets=[1, 9], budget_capacity=4)
    assert packs == [[0]] and packs.stats.skipped == 1
    with pytest.raises(ValueError, match=r"item 0: length must be >= 1"):
        pack_lengths([0, 3], 10, overlong="skip")
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        pack_lengths([1.5, 2.0], 10)
    with pytest.raises(ValueError, match="budgets exactly"):
        pack_lengths([1, 2], 10, budgets=[1, 1])
    with pytest.raises(ValueError, match="unknown strategy"):
        pack_lengths([1, 2], 10, "worst_fit")
    assert (
        pack_lengths([], 10, "ffd") == [] == pack_lengths(np.array([], dtype=np.int64), 10, "bfd")
    )


def test_decreasing_beats_streaming_fill_on_long_tail():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(1500), 1.0, 20_000)), 1, 32_000).astype(np.int64)
    fills = {s: pack_lengths(lengths, 32_000, s).stats.fill_ratio for s in STRATEGIES}
    assert fills["ffd"] >= fills["first_fit"] > fills["next_fit"]
    assert fills["bfd"] >= fills["best_fit"] > fills["next_fit"]
    assert fills["first_fit"] > 0.99
