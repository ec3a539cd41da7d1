"""StreamPacker: exact strategies (against naive references), budgets, overlong, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmms_pack import STREAM_STRATEGIES, StreamPacker, pack_lengths

SETTINGS = settings(max_examples=150, deadline=None)


def reference_stream(lengths, cap, strategy, max_open_bins, budgets=None, bcap=None):
    """Textbook packing of regular items (1 <= n <= cap), written for clarity, not speed."""
    budgets = budgets or [0] * len(lengths)
    bcap = 0 if bcap is None else bcap
    maxb = 1 if strategy == "next_fit" else max_open_bins
    open_bins, out = [], []  # open bin: [indices, tokens, budget]
    for i, (n, b) in enumerate(zip(lengths, budgets)):
        if n == cap:
            out.append([i])
            continue
        fits = [k for k, (_, t, u) in enumerate(open_bins) if t + n <= cap and u + b <= bcap]
        if fits:
            if strategy == "best_fit":
                k = min(fits, key=lambda k: (cap - open_bins[k][1], k))
            else:
                k = fits[0]
            open_bins[k][0].append(i)
            open_bins[k][1] += n
            open_bins[k][2] += b
            if open_bins[k][1] == cap:
                out.append(open_bins.pop(k)[0])
            continue
        if len(open_bins) == maxb:  # emit the fullest (ties: earliest opened)
            k = max(range(len(open_bins)), key=lambda k: (open_bins[k][1], -k))
            out.append(open_bins.pop(k)[0])
        open_bins.append([[i], n, b])
    out.extend(b[0] for b in open_bins)
    return out


@st.composite
def streams(draw, overlong=False, budget=False):
    cap = draw(st.integers(1, 40))
    hi = 2 * cap + 1 if overlong else cap
    small = st.integers(1, max(1, cap // 3))  # many equal lengths: ties between bins
    lengths = draw(st.lists(st.one_of(st.integers(1, hi), small), max_size=60))
    strategy = draw(st.sampled_from(STREAM_STRATEGIES))
    maxb = draw(st.integers(1, 6))
    if not budget:
        return cap, lengths, strategy, maxb, None, None
    bcap = draw(st.integers(0, 10))
    budgets = draw(st.lists(st.integers(0, bcap), min_size=len(lengths), max_size=len(lengths)))
    return cap, lengths, strategy, maxb, budgets, bcap


def run(cap, lengths, strategy, maxb, budgets=None, bcap=None, overlong="error"):
    packer = StreamPacker(cap, strategy, maxb, overlong, budget_capacity=bcap)
    budget = None if budgets is None else budgets.__getitem__
    return list(packer.pack(range(len(lengths)), length=lengths.__getitem__, budget=budget)), packer


@SETTINGS
@given(streams())
def test_matches_reference(case):
    cap, lengths, strategy, maxb, _, _ = case
    packs, packer = run(cap, lengths, strategy, maxb)
    assert packs == reference_stream(lengths, cap, strategy, maxb)
    assert packer.stats.items == len(lengths) and packer.stats.packs == len(packs)
    assert packer.stats.tokens == sum(lengths)


@SETTINGS
@given(streams(budget=True))
def test_budget_matches_reference_and_holds(case):
    cap, lengths, strategy, maxb, budgets, bcap = case
    packs, packer = run(cap, lengths, strategy, maxb, budgets, bcap)
    assert packs == reference_stream(lengths, cap, strategy, maxb, budgets, bcap)
    assert all(sum(budgets[i] for i in p) <= bcap for p in packs)
    assert packer.stats.budget == sum(budgets)


@SETTINGS
@given(streams(overlong=True), st.sampled_from(["skip", "truncate"]))
def test_every_item_once_or_counted(case, policy):
    cap, lengths, strategy, maxb, _, _ = case
    packer = StreamPacker(cap, strategy, maxb, policy, truncate_fn=lambda item, cap: (item[0], cap))
    packs = list(packer.pack(list(enumerate(lengths)), length=lambda item: item[1]))
    seen = sorted(i for p in packs for i, _ in p)
    overlong = [i for i, n in enumerate(lengths) if n > cap]
    if policy == "skip":
        assert seen == [i for i, n in enumerate(lengths) if n <= cap]
        assert packer.stats.skipped == len(overlong) and packer.stats.truncated == 0
    else:
        assert seen == list(range(len(lengths)))
        assert packer.stats.truncated == len(overlong) and packer.stats.skipped == 0
        assert all(
            p == [(i, cap)] for p in packs for i, _ in p if i in overlong
        )  # a full pack alone
    assert all(sum(n for _, n in p) <= cap for p in packs)
    assert packer.stats.items + packer.stats.skipped == len(lengths) == packer.consumed
    assert packer.stats.tokens == sum(
        min(n, cap) for n in lengths if policy == "truncate" or n <= cap
    )


def test_int_items_truncate_to_capacity():
    packer = StreamPacker(10, overlong="truncate")
    assert list(packer.pack([4, 25, 6])) == [[10], [4, 6]] and packer.stats.truncated == 1
    with pytest.raises(TypeError, match="truncate_fn"):  # indices are not lengths: no default
        list(StreamPacker(10, overlong="truncate").pack([0, 1], length=[4, 25].__getitem__))


@SETTINGS
@given(streams(budget=True))
def test_deterministic(case):
    cap, lengths, strategy, maxb, budgets, bcap = case
    assert (
        run(cap, lengths, strategy, maxb, budgets, bcap)[0]
        == run(cap, lengths, strategy, maxb, budgets, bcap)[0]
    )


@SETTINGS
@given(streams(overlong=True, budget=True), st.sampled_from(["skip", "truncate"]))
def test_resume_from_every_cut_point(case, policy):
    cap, lengths, strategy, maxb, budgets, bcap = case
    items = [{"id": i, "n": n, "b": b} for i, (n, b) in enumerate(zip(lengths, budgets))]

    def packer():
        return StreamPacker(cap, strategy, maxb, policy, budget_capacity=bcap, truncate_fn=_cut)

    def pack(p, stream):
        return p.pack(stream, length=lambda x: x["n"], budget=lambda x: x["b"])

    whole, states = [], []
    p = packer()
    states.append(json.loads(json.dumps(p.state_dict())))  # cut before the first pack
    for out in pack(p, items):
        whole.append(out)
        assert len(p.state_dict()["bins"]) <= maxb  # memory: the open bins only
        states.append(json.loads(json.dumps(p.state_dict())))  # JSON round trip: plain data
    for k, state in enumerate(states):
        q = packer()
        q.load_state_dict(state)
        assert whole[:k] + list(pack(q, items[state["consumed"] :])) == whole
        assert q.stats == p.stats


def _cut(item, cap):
    return {**item, "n": cap}


def test_state_tracks_items_pulled_lazily():
    pulled = []

    def stream():
        for n in [5, 6, 7, 3, 9, 10, 2, 2, 8, 4, 1]:
            pulled.append(n)
            yield n

    packer = StreamPacker(10, "first_fit", 2)
    for _ in packer.pack(stream()):
        assert packer.consumed == packer.state_dict()["consumed"] == len(pulled)
    assert packer.consumed == 11


def test_first_fit_evicts_fullest_and_emits_full_bins_at_once():
    packer = StreamPacker(10, "first_fit", 2)
    stream = packer.pack([3, 4, 5, 6, 5, 10, 3])
    assert next(stream) == [3, 4]  # 6 fits neither [3, 4] nor [5]: the fullest goes
    assert next(stream) == [5, 5]  # exactly full: emitted when the second 5 lands
    assert next(stream) == [10]  # a full-length item goes alone; open bins untouched
    assert [b["items"] for b in packer.state_dict()["bins"]] == [[6]]  # the last 3 not pulled yet
    assert packer.consumed == 6
    assert list(stream) == [[6, 3]]
    assert packer.stats.fill_ratio == pytest.approx(36 / 40)
    assert packer.stats.as_dict() == {
        **{"capacity": 10, "budget_capacity": None, "packs": 4, "items": 7, "tokens": 36},
        **{"budget": 0, "skipped": 0, "truncated": 0, "fill_ratio": pytest.approx(0.9)},
    }


def test_best_fit_picks_tightest():
    packer = StreamPacker(10, "best_fit", 3)
    assert list(packer.pack([5, 7, 6, 3])) == [[7, 3], [5], [6]]
    assert list(StreamPacker(10, "first_fit", 3).pack([5, 7, 6, 3])) == [[5, 3], [7], [6]]


def test_ties_go_to_the_earliest_bin():
    for strategy in ("first_fit", "best_fit"):
        assert list(StreamPacker(10, strategy, 3).pack([6, 6, 2])) == [[6, 2], [6]]
    # fullest-bin eviction: "a" and "b" are equally full, the earliest goes
    for strategy in ("first_fit", "best_fit"):
        stream = StreamPacker(10, strategy, 2).pack(
            [(6, "a"), (6, "b"), (5, "c")], length=lambda x: x[0]
        )
        assert next(stream) == [(6, "a")]
    budgeted = StreamPacker(10, "best_fit", 3, budget_capacity=5)
    packs = list(
        budgeted.pack([(6, 1), (6, 1), (2, 1)], length=lambda x: x[0], budget=lambda x: x[1])
    )
    assert packs == [[(6, 1), (2, 1)], [(6, 1)]]


def test_next_fit_keeps_one_bin():
    packer = StreamPacker(10, "next_fit", max_open_bins=8)
    assert packer.max_open_bins == 1
    assert list(packer.pack([6, 3, 5, 5, 4])) == [[6, 3], [5, 5], [4]]


def test_overlong_error_names_index_and_length():
    packer = StreamPacker(10)
    stream = packer.pack([3, 4, 12, 5])
    with pytest.raises(ValueError, match=r"item 2 is overlong: length 12 > capacity 10"):
        list(stream)
    packer = StreamPacker(10, budget_capacity=2)
    with pytest.raises(ValueError, match=r"item 1 is overlong: budget 3 > budget_capacity 2"):
        list(packer.pack([1, 2], budget=lambda n: n + 1))


def test_index_counts_across_resume():
    packer = StreamPacker(10, max_open_bins=1)
    stream = packer.pack([6, 6, 6])
    next(stream)
    state = packer.state_dict()
    resumed = StreamPacker(10, max_open_bins=1)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"item 3 is overlong: length 11"):
        list(resumed.pack([6, 11]))  # items 2 and 3 of the whole stream


def test_over_budget_is_skipped_and_counted_unless_error():
    for policy in ("skip", "truncate"):
        packer = StreamPacker(10, overlong=policy, budget_capacity=4)
        packs = list(
            packer.pack([(3, 1), (4, 5), (2, 4)], length=lambda x: x[0], budget=lambda x: x[1])
        )
        assert packs == [[(3, 1)], [(2, 4)]] and packer.stats.skipped == 1


def test_truncate_sample_dicts_by_default():
    sample = {
        "input_ids": np.arange(12),
        "labels": np.arange(12),
        "position_ids": np.tile(np.arange(12), (3, 1)),
    }
    packer = StreamPacker(8, overlong="truncate")
    (pack,) = packer.pack([sample], length=lambda s: len(s["input_ids"]))
    assert pack[0]["length"] == 8 and pack[0]["position_ids"].shape == (3, 8)
    assert packer.stats.truncated == 1
    with pytest.raises(TypeError, match="truncate_fn"):
        list(StreamPacker(8, overlong="truncate").pack(["x" * 9], length=len))


def test_custom_truncate_may_leave_room():
    packer = StreamPacker(10, overlong="truncate", truncate_fn=lambda s, cap: s[: cap // 2])
    assert list(packer.pack(["a" * 30, "bb", "c" * 3], length=len)) == [["aaaaa", "bb", "ccc"]]
    with pytest.raises(ValueError, match="truncate_fn returned"):
        list(
            StreamPacker(10, overlong="truncate", truncate_fn=lambda s, cap: s).pack(
                ["a" * 30], length=len
            )
        )


def test_flush_false_carries_bins_to_the_next_epoch():
    lengths = [4, 7, 2, 9, 3, 5, 5, 1, 8]
    packer = StreamPacker(10, "first_fit", 3)
    first = list(packer.pack(lengths[:5], flush=False))
    rest = list(packer.pack(lengths[5:]))
    assert first + rest == list(StreamPacker(10, "first_fit", 3).pack(lengths))


def test_stream_packer_and_pack_lengths_agree():
    lengths = np.random.default_rng(0).integers(1, 100, 500)
    for strategy in STREAM_STRATEGIES:
        ints = list(StreamPacker(100, strategy, 4).pack(lengths.tolist()))
        idx = pack_lengths(lengths, 100, strategy, max_open_bins=4)
        assert [[int(lengths[i]) for i in p] for p in idx] == ints


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 8, "strategy": "ffd"}, "unknown strategy"),
        ({"capacity": 8, "max_open_bins": 0}, "max_open_bins"),
        ({"capacity": 8, "overlong": "drop"}, "overlong"),
        ({"capacity": 8, "budget_capacity": -1}, "budget_capacity"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamPacker(**kwargs)


def test_bad_lengths_and_budget_wiring():
    with pytest.raises(ValueError, match=r"item 1: length must be >= 1"):
        list(StreamPacker(8).pack([3, 0]))
    with pytest.raises(TypeError, match=r"item 0: length must be an int"):
        list(StreamPacker(8).pack([3.5], length=lambda x: x * 10))
    with pytest.raises(ValueError, match="budget_capacity"):
        StreamPacker(8).pack([1], budget=lambda x: 1)
    with pytest.raises(ValueError, match="budget_capacity"):
        StreamPacker(8, budget_capacity=3).pack([1])


def test_one_iterator_at_a_time_and_no_load_while_running():
    packer = StreamPacker(10, max_open_bins=1)
    a = packer.pack([6, 6, 6])
    next(a)
    with pytest.raises(RuntimeError, match="still running"):
        next(packer.pack([1]))
    with pytest.raises(RuntimeError, match="running"):
        packer.load_state_dict(packer.state_dict())
    a.close()  # closing (or exhausting) the iterator frees the packer; the open bins stay
    assert packer.open_bins == 1
    assert list(packer.pack([])) == [[6]]


def test_load_rejects_other_config_and_corrupt_state():
    state = StreamPacker(10, "first_fit", 4).state_dict()
    with pytest.raises(ValueError, match="different config"):
        StreamPacker(10, "best_fit", 4).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        StreamPacker(10, "first_fit", 4).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="inconsistent"):
        StreamPacker(10, "first_fit", 4).load_state_dict({**state, "consumed": 3})
