"""`max_vision_tokens_per_pack`: a second packing budget bounds each pack's vision tokens (so the
vision work per data-parallel rank stays bounded); every record still lands exactly once, and a
sample over the budget takes a pack's whole budget instead of failing."""

from __future__ import annotations

import numpy as np
import pytest
from lmms_data_testutil import batch_ids, id_processor, write_id_parquet

from lmms_data import DatasetConfig, SlotStream
from lmms_data._loader import discover


def vision_processor(messages: list) -> dict:
    """``id_processor`` plus vision tokens: every 5th record is image-heavy (40), some 10th
    exceeds any budget below (90), the rest have 0-6."""
    sample = id_processor(messages)
    i = int(sample["input_ids"][0])
    sample["vision_tokens"] = 90 if i % 10 == 5 else 40 if i % 5 == 0 else i % 7
    sample["length"] = int(sample["length"]) + sample["vision_tokens"]
    sample["input_ids"] = np.full(sample["length"], i, dtype=np.int64)
    sample["labels"] = sample["input_ids"].copy()
    return sample


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_id_parquet(str(tmp_path_factory.mktemp("vb") / "d.parquet"), range(120))


def _packs(path, budget):
    cfg = DatasetConfig(dataset_path=path, packing_length=128, num_epochs=1, shuffle_buffer=0,
                        max_vision_tokens_per_pack=budget)  # fmt: skip
    stream = SlotStream(cfg, discover(cfg, 1), vision_processor, slot=0, n_slots=1)
    return list(stream)


def test_budget_bounds_vision_tokens_per_pack(data):
    free = _packs(data, None)
    capped = _packs(data, 60)
    for packs in (free, capped):
        assert sorted(i for b in packs for i in batch_ids(b)) == list(range(120))
    heavy = max(b["vision_tokens"] for b in free)
    assert heavy > 90  # without the budget, heavy samples share packs
    # with it: at most 60, but for a single sample that alone exceeds the budget
    for b in capped:
        ids = sorted(set(batch_ids(b)))
        over = [i for i in ids if i % 10 == 5]
        assert b["vision_tokens"] <= 60 or (len(over) == 1 and b["vision_tokens"] <= 90 + 6 * 6)
    over_cap = lambda ps: sum(b["vision_tokens"] > 60 for b in ps)  # noqa: E731
    assert over_cap(capped) < over_cap(free)
    with pytest.raises(ValueError, match="max_vision_tokens_per_pack"):
        DatasetConfig(dataset_path=data, max_vision_tokens_per_pack=0)
