"""Config keys, registries (custom dataset types), and packed-batch collation of media."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from lmms_data_testutil import batch_ids, id_processor

import lmms_data as ld
from lmms_data import DatasetConfig, collate_packed_batch, register_dataset


def test_unknown_keys_rejected_with_suggestion():
    with pytest.raises(ValueError, match=r"'packing_lenght' \(did you mean 'packing_length'\?\)"):
        DatasetConfig.from_dict({"dataset_path": "x", "packing_lenght": 10})
    cfg = DatasetConfig.from_dict({"dataset_path": ["a", "b"], "mixture_weights": [1, 2]})
    assert cfg.paths == ["a", "b"]
    with pytest.raises(ValueError, match="mixture_weights"):
        DatasetConfig(dataset_path=["a", "b"], mixture_weights=[1.0])
    with pytest.raises(ValueError, match="bad_record_policy"):
        DatasetConfig(bad_record_policy="ignore")
    ld.check_keys({"a": 1}, ["a", "b"], "x")


def test_registry_refuses_duplicates_and_lists_names():
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("chat")(lambda r: r)
    with pytest.raises(KeyError, match=r"registered: .*qwen2_5_vl.*Did you mean 'qwen3_vl'"):
        ld.PROCESSOR_REGISTRY.get("qwen3_v")


def test_synthetic_kinds_registry(tmp_path, monkeypatch):
    """A family's demo data registers its kind (BAGEL's from lmms_data.processors); a kind is
    registered once, and an unknown kind names the known ones."""
    assert {"vl", "text", "audio", "omni", "shapes", "clips", "preference", "bagel"} <= set(
        ld.SYNTHETIC_KINDS.names()
    )
    with pytest.raises(ValueError, match="already registered"):
        ld.register_synthetic_kind("bagel")(lambda *a, **k: None)

    # the kind registered below is gone after the test (a copy of the registry's table)
    monkeypatch.setattr(ld.SYNTHETIC_KINDS, "_items", dict(ld.SYNTHETIC_KINDS._items))

    @ld.register_synthetic_kind("test_rows")
    def rows(out, n, *, format, seed, image_size):
        (tmp_path / "rows.txt").write_text(f"{n} {format} {seed} {image_size}")

    ld.generate_synthetic("test_rows", str(tmp_path), 3, seed=5)
    assert (tmp_path / "rows.txt").read_text() == "3 parquet 5 64"
    with pytest.raises(ValueError, match=r"known: .*test_rows"):
        ld.generate_synthetic("test_rowz", str(tmp_path), 3)
    ld.generate_synthetic("bagel", str(tmp_path / "bagel"), 4)
    assert (tmp_path / "bagel" / "shard-00000.parquet").exists()


def test_custom_dataset_type(tmp_path):
    @register_dataset("test_captions")
    def captions(rec):
        return {"messages": [{"role": "user", "content": f"id {rec['n']}"},
                             {"role": "assistant", "content": rec["caption"]}]}  # fmt: skip

    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"n": i, "caption": "hi"}) + "\n" for i in range(9))
    )
    cfg = DatasetConfig(dataset_type="test_captions", dataset_path=str(tmp_path / "c.jsonl"),
                        packing_length=16, num_epochs=1, shuffle=False)  # fmt: skip
    got = [i for b in ld.build_dataloader(cfg, id_processor, num_workers=0) for i in batch_ids(b)]
    assert sorted(got) == list(range(9))


def _s(n, grid=None, mm=False):
    ids = np.arange(n, dtype=np.int64) + 10
    s = {"input_ids": ids, "labels": ids.copy(), "length": n,
         "position_ids": np.tile(np.arange(n), (4, 1)), "vision_tokens": 0}  # fmt: skip
    if grid is not None:
        s["image_grid_thw"] = np.array([grid])
        s["pixel_values"] = np.full((int(np.prod(grid)), 6), float(n), np.float32)
        s["vision_tokens"] = int(np.prod(grid)) // 4
    if mm:
        s["mm_token_type_ids"] = np.ones(n, np.int64)
    return s


def test_collate_concatenates_media_in_pack_order():
    b = collate_packed_batch(
        [_s(5, [1, 2, 2], mm=True), _s(3), _s(4, [1, 4, 2])], pad_to_multiple_of=8
    )
    assert b["input_ids"].shape == (16,) and b["position_ids"].shape == (4, 16)
    assert b["cu_seqlens"].tolist() == [0, 5, 8, 12, 16]
    assert b["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 2]]
    assert (
        b["pixel_values"][:4, 0].tolist() == [5.0] * 4
        and b["pixel_values"][4:, 0].tolist() == [4.0] * 8
    )
    assert b["mm_token_type_ids"].tolist() == [1] * 5 + [0] * 11
    assert b["vision_tokens"] == 3 and isinstance(b["input_ids"], torch.Tensor)
