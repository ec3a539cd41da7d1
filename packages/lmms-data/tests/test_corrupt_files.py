"""Truncated / corrupt Parquet, Arrow and gzip files under the bad-record policy, empty files, and
the dataset fingerprint that makes a resume after the files changed say so."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from lmms_data_testutil import batch_ids, id_processor, id_record, write_id_parquet

from lmms_data import (
    BadRecordError,
    DatasetChangedError,
    DatasetConfig,
    SlotStream,
    build_dataloader,
)
from lmms_data._loader import discover


def _corrupt_row_group(path: str, group: int) -> None:
    """Overwrite the page header of one row group's column in place (the footer stays valid)."""
    col = pq.ParquetFile(path).metadata.row_group(group).column(0)
    with open(path, "r+b") as f:
        f.seek(col.dictionary_page_offset or col.data_page_offset)
        f.write(b"\xab" * 16)


@pytest.fixture()
def corpus(tmp_path) -> str:
    """ids 0-29 good (a.parquet), ids 100-129 with row group 1 (110-119) corrupt (b.parquet),
    a truncated Parquet file, an Arrow file of random bytes, a truncated gzip JSONL file."""
    d = tmp_path / "data"
    write_id_parquet(str(d / "a.parquet"), range(30))
    write_id_parquet(str(d / "b.parquet"), range(100, 130))
    _corrupt_row_group(str(d / "b.parquet"), 1)
    good = write_id_parquet(str(tmp_path / "c.parquet"), range(200, 230))
    data = Path(good).read_bytes()
    (d / "c_truncated.parquet").write_bytes(data[: len(data) // 2])
    (d / "d_garbage.arrow").write_bytes(os.urandom(3000))
    lines = "".join(json.dumps(id_record(i)) + "\n" for i in range(300, 400)).encode()
    (d / "e.jsonl.gz").write_bytes(gzip.compress(lines)[:-200])  # cut before its end
    return str(d)


def test_skip_counts_each_unreadable_part_and_reads_the_rest(corpus):
    cfg = DatasetConfig(dataset_path=corpus, shuffle=False, num_epochs=1, packing_length=64)
    stream = SlotStream(cfg, discover(cfg, 1), id_processor, slot=0, n_slots=1)
    ids = [i for batch in stream for i in batch_ids(batch)]
    assert stream.stats.bad == {"corrupt_file": 4}, stream.stats.examples
    examples = "\n".join(stream.stats.examples)
    for needle in ("b.parquet", "row group 1", "c_truncated.parquet", "d_garbage.arrow", "e.jsonl"):
        assert needle in examples, examples
    good = set(range(30)) | set(range(100, 110)) | set(range(120, 130))
    assert good <= set(ids) and not set(ids) & set(range(110, 120)), sorted(ids)
    assert set(ids) - good and set(ids) - good < set(range(300, 400))  # the gzip's intact lines


def test_raise_names_the_file_at_start_up(corpus, tmp_path):
    cfg = DatasetConfig(dataset_path=corpus, bad_record_policy="raise")
    with pytest.raises(BadRecordError, match=r"\[corrupt_file\] unreadable file: .*c_truncated"):
        build_dataloader(cfg, id_processor, num_workers=0)
    # a readable footer but an unreadable row group: raised when it is reached, naming both
    d = tmp_path / "one"
    _corrupt_row_group(write_id_parquet(str(d / "b.parquet"), range(30)), 2)
    cfg = DatasetConfig(
        dataset_path=str(d), bad_record_policy="raise", shuffle=False, packing_length=64
    )
    loader = build_dataloader(cfg, id_processor, num_workers=0)
    with pytest.raises(BadRecordError, match=r"row group 2 is unreadable.* at .*b\.parquet"):
        list(loader)


def test_empty_files(tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds no records \(2 of 2 file\(s\) are empty"):
        build_dataloader(DatasetConfig(dataset_path=str(tmp_path)), id_processor)
    write_id_parquet(str(tmp_path / "ok.parquet"), range(5))  # empty files beside good ones
    loader = build_dataloader(
        DatasetConfig(dataset_path=str(tmp_path), num_epochs=1, shuffle=False), id_processor,
        num_workers=0,
    )  # fmt: skip
    assert sorted(i for b in loader for i in batch_ids(b)) == list(range(5))


def test_resume_after_the_files_changed_says_what_changed(tmp_path):
    d = tmp_path / "data"
    write_id_parquet(str(d / "a.parquet"), range(40))
    cfg = DatasetConfig(dataset_path=str(d), packing_length=32)
    loader = build_dataloader(cfg, id_processor, num_workers=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    moved = tmp_path / "moved"  # the same files elsewhere: same fingerprint
    os.rename(d, moved)
    same = build_dataloader(
        DatasetConfig(dataset_path=str(moved), packing_length=32), id_processor, num_workers=0
    )
    same.load_state_dict(state)
    write_id_parquet(str(moved / "a.parquet"), range(30))
    write_id_parquet(str(moved / "b.parquet"), range(5))
    changed = build_dataloader(
        DatasetConfig(dataset_path=str(moved), packing_length=32), id_processor, num_workers=0
    )
    with pytest.raises(DatasetChangedError) as info:
        changed.load_state_dict(state)
    assert "a.parquet: " in str(info.value) and "bytes" in str(info.value), info.value
    assert "1 file(s) added (e.g. b.parquet)" in str(info.value), info.value
