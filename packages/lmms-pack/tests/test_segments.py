"""A sample with ``segments`` (e.g. a preference pair) is several documents of one row."""

from __future__ import annotations

import numpy as np
import pytest

from lmms_pack import collate_packed

IGNORE = -100


def test_segments_split_a_sample_into_documents():
    pair = {"input_ids": np.arange(1, 8), "labels": np.arange(1, 8), "segments": [4, 3]}
    single = {"input_ids": np.arange(10, 13), "labels": np.arange(10, 13)}
    row = collate_packed([pair, single], pad_to_multiple_of=4)
    assert row["cu_seqlens"].tolist() == [0, 4, 7, 10, 12]
    assert row["num_samples"] == 3  # documents; the padding segment is not one
    assert row["sample_segments"].tolist() == [2, 1]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 1]
    assert row["labels"][[0, 4, 7]].tolist() == [IGNORE] * 3  # every document's first token
    # within a document the next token is the target; never across a document boundary
    assert row["shift_labels"].tolist() == [
        2,
        3,
        4,
        IGNORE,
        6,
        7,
        IGNORE,
        11,
        12,
        IGNORE,
        IGNORE,
        IGNORE,
    ]
    # the same two documents as two samples give the same row, without sample_segments
    apart = collate_packed(
        [
            {"input_ids": np.arange(1, 5), "labels": np.arange(1, 5)},
            {"input_ids": np.arange(5, 8), "labels": np.arange(5, 8)},
            single,
        ],
        pad_to_multiple_of=4,
    )
    for key in ("input_ids", "labels", "shift_labels", "position_ids", "cu_seqlens"):
        assert np.array_equal(row[key], apart[key]), key
    assert "sample_segments" not in apart


def test_given_positions_are_kept_per_sample_and_bad_segments_refused():
    pos = np.array([[0, 1, 2, 0, 1], [5, 6, 7, 5, 6]])
    pair = {
        "input_ids": np.arange(5),
        "labels": np.arange(5),
        "position_ids": pos,
        "segments": [3, 2],
    }
    row = collate_packed([pair])
    assert np.array_equal(row["position_ids"], pos)
    with pytest.raises(ValueError, match="segments"):
        collate_packed([{**pair, "segments": [3, 3]}])
