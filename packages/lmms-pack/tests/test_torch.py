"""lmms_pack.torch: the torch variant gives the numpy row as tensors."""

from __future__ import annotations

import numpy as np
import pytest

from lmms_pack import collate_packed

torch = pytest.importorskip("torch")


def test_collate_packed_torch_matches_numpy():
    from lmms_pack.torch import collate_packed_torch

    samples = [
        {
            "input_ids": torch.arange(5),
            "labels": torch.arange(5),
            "position_ids": torch.arange(15).reshape(3, 5),
        },
        {"input_ids": np.arange(3), "labels": [1, 2, 3]},
    ]
    row = collate_packed_torch(samples, pad_to_multiple_of=4)
    ref = collate_packed(samples, pad_to_multiple_of=4)
    assert row.keys() == ref.keys()
    for key, value in ref.items():
        if isinstance(value, np.ndarray):
            assert isinstance(row[key], torch.Tensor)
            np.testing.assert_array_equal(row[key].numpy(), value)
        else:
            assert row[key] == value and isinstance(row[key], int)
    assert row["cu_seqlens"].dtype == torch.int32 and row["input_ids"].dtype == torch.int64
    assert row["position_ids"].shape == (3, 8)  # 5 + 3 tokens, a multiple of 4


def test_lazy_attribute():
    import lmms_pack

    assert lmms_pack.torch.collate_packed_torch is not None
    with pytest.raises(AttributeError):
        lmms_pack.nope  # noqa: B018
