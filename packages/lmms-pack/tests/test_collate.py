"""collate_packed: cu_seqlens, positions (1-D and multi-row), labels, padding segment."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmms_pack import IGNORE_INDEX, collate_packed, truncate_sample

IGN = IGNORE_INDEX


def sample(n, start=1, prompt=0, rows=None):
    ids = np.arange(start, start + n)
    labels = ids.copy()
    labels[:prompt] = IGN
    s = {"input_ids": ids, "labels": labels, "length": n}
    if rows:
        s["position_ids"] = np.stack([np.arange(n) * (r + 1) + 7 * r for r in range(rows)])
    return s


def test_row_layout():
    row = collate_packed([sample(3, 10), sample(2, 20, prompt=1), sample(4, 30)])
    assert row["input_ids"].tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 33]
    assert row["cu_seqlens"].tolist() == [0, 3, 5, 9] and row["cu_seqlens"].dtype == np.int32
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    # Unshifted labels: every sample's first token is ignored, so no row-wide shift trains
    # a sample's last token on the next sample's first.
    assert row["labels"].tolist() == [IGN, 11, 12, IGN, 21, IGN, 31, 32, 33]
    assert row["shift_labels"].tolist() == [11, 12, IGN, 21, IGN, 31, 32, 33, IGN]
    assert row["max_seqlen"] == 4 and row["num_samples"] == 3 and row["num_loss_tokens"] == 6
    for key in ("input_ids", "labels", "shift_labels", "position_ids"):
        assert row[key].dtype == np.int64


def test_padding_is_its_own_ignored_segment():
    row = collate_packed([sample(3), sample(2)], pad_to_multiple_of=4, pad_token_id=9)
    assert row["input_ids"].tolist()[5:] == [9, 9, 9]
    assert row["cu_seqlens"].tolist() == [0, 3, 5, 8]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row["labels"].tolist()[5:] == [IGN] * 3 and row["shift_labels"].tolist()[4:] == [IGN] * 4
    assert row["num_samples"] == 2 and row["max_seqlen"] == 3
    assert collate_packed([sample(4)], pad_to_multiple_of=4)["cu_seqlens"].tolist() == [
        0,
        4,
    ]  # no empty segment


def test_multi_row_positions_preserved_and_text_broadcast():
    a, b = sample(3, rows=4), sample(2)
    row = collate_packed([a, b], pad_to_multiple_of=8)
    pos = row["position_ids"]
    assert pos.shape == (4, 8)
    np.testing.assert_array_equal(pos[:, :3], a["position_ids"])
    np.testing.assert_array_equal(
        pos[:, 3:5], np.tile([0, 1], (4, 1))
    )  # no positions: arange in every row
    np.testing.assert_array_equal(pos[:, 5:], np.tile([0, 1, 2], (4, 1)))  # padding segment
    with pytest.raises(ValueError, match="different row counts"):
        collate_packed([sample(3, rows=4), sample(3, rows=3)])


def test_fractional_positions_keep_their_dtype():
    a = sample(3, rows=4)
    a["position_ids"] = a["position_ids"].astype(np.float32) + np.float32(0.5)
    row = collate_packed([a, sample(2)], pad_to_multiple_of=8)
    assert row["position_ids"].dtype == np.float32  # not truncated to int64
    np.testing.assert_array_equal(row["position_ids"][:, :3], a["position_ids"])
    np.testing.assert_array_equal(row["position_ids"][:, 3:5], np.tile([0.0, 1.0], (4, 1)))


def test_given_1d_positions_are_kept():
    s = sample(3)
    s["position_ids"] = np.array([4, 5, 6])
    assert collate_packed([sample(2), s])["position_ids"].tolist() == [0, 1, 4, 5, 6]


@pytest.mark.parametrize(
    ("bad", "err", "match"),
    [
        ({"input_ids": [1, 2]}, KeyError, "labels"),
        ({"input_ids": [1, 2], "labels": [1]}, ValueError, "one length"),
        ({"input_ids": [], "labels": []}, ValueError, "non-empty"),
        ({"input_ids": [1, 2], "labels": [1, 2], "length": 3}, ValueError, "length=3"),
        (
            {"input_ids": [1, 2], "labels": [1, 2], "position_ids": [[0, 1, 2]]},
            ValueError,
            "position_ids shape",
        ),
    ],
)
def test_bad_samples(bad, err, match):
    with pytest.raises(err, match=match):
        collate_packed([sample(2), bad])
    with pytest.raises(ValueError, match="at least one"):
        collate_packed([])


def test_truncate_sample():
    s = {**sample(6, rows=3), "pixel_values": np.ones((2, 3))}
    t = truncate_sample(s, 4)
    assert t["input_ids"].tolist() == [1, 2, 3, 4] and t["length"] == 4
    assert t["position_ids"].shape == (3, 4) and t["pixel_values"] is s["pixel_values"]
    assert s["length"] == 6  # the input is not modified


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=8),
    st.one_of(st.none(), st.integers(1, 16)),
    st.data(),
)
def test_row_properties(lengths, multiple, data):
    samples = []
    for n in lengths:
        labels = data.draw(
            st.lists(
                st.integers(-100, 50).map(lambda x: x if x >= 0 else IGN), min_size=n, max_size=n
            )
        )
        samples.append({"input_ids": np.arange(n) + 1000, "labels": np.array(labels)})
    row = collate_packed(samples, pad_to_multiple_of=multiple)
    cu, total = row["cu_seqlens"], len(row["input_ids"])
    real = sum(lengths)
    assert cu[0] == 0 and cu[len(lengths)] == real and cu[-1] == total
    assert total % (multiple or 1) == 0 and total - real < (multiple or 1)
    assert len(cu) == len(lengths) + 1 + (total > real)
    assert row["max_seqlen"] == int(np.diff(cu).max())
    seg = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    trained = np.flatnonzero(row["shift_labels"] != IGN)
    assert row["num_loss_tokens"] == len(trained)
    assert np.all(trained + 1 < real) and np.all(
        seg[trained] == seg[trained + 1]
    )  # never across samples
    for s, a, b in zip(samples, cu[:-1], cu[1:]):
        np.testing.assert_array_equal(row["position_ids"][a:b], np.arange(b - a))
        np.testing.assert_array_equal(row["input_ids"][a:b], s["input_ids"])
        np.testing.assert_array_equal(row["shift_labels"][a : b - 1], s["labels"][1:])
        np.testing.assert_array_equal(row["labels"][a + 1 : b], s["labels"][1:])
    assert np.all(row["labels"][real:] == IGN) and np.all(
        row["position_ids"][real:] == np.arange(total - real)
    )
