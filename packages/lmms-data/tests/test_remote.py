"""Parquet behind a URL (lmms_data._remote): fsspec's in-memory filesystem stands in for
`hf://` / `s3://` (same code path: list, sizes, ranged row-group reads); no network."""

from __future__ import annotations

import itertools
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from lmms_data_testutil import batch_ids, id_processor, id_record, write_id_parquet

from lmms_data import DatasetConfig, build_dataloader, dataset_fingerprint


@pytest.fixture
def remote(tmp_path):
    """The same three shards under a local folder and under memory://ids-<n>/train/."""
    fs = fsspec.filesystem("memory")
    root = f"memory://ids-{tmp_path.name}/train"
    for shard in range(3):
        ids = range(shard * 50, shard * 50 + 50)
        write_id_parquet(str(tmp_path / "local" / f"part-{shard}.parquet"), ids, rows_per_group=8)
        msgs = [json.dumps(id_record(i)["messages"]) for i in ids]
        with fs.open(f"{root}/part-{shard}.parquet", "wb") as f:
            pq.write_table(pa.table({"messages": msgs}), f, row_group_size=8)
    with fs.open(f"{root}/README.md", "wb") as f:
        f.write(b"not data")
    yield {"local": str(tmp_path / "local"), "url": root}
    fs.rm(root.split("/train")[0], recursive=True)


def _loader(path: str, rank: int = 0, world: int = 1):
    cfg = DatasetConfig(dataset_path=path, packing_length=24, shuffle_buffer=16, seed=5)
    return build_dataloader(cfg, id_processor, dp_rank=rank, dp_world=world, num_workers=0)


def test_url_streams_as_the_local_copy_and_resumes_exactly(remote):
    for rank in range(2):  # a rank's batches from the URL are the local copy's
        local = [
            batch_ids(b) for b in itertools.islice(iter(_loader(remote["local"], rank, 2)), 12)
        ]
        url = [batch_ids(b) for b in itertools.islice(iter(_loader(remote["url"], rank, 2)), 12)]
        assert url == local
    ref = [batch_ids(b) for b in itertools.islice(iter(_loader(remote["url"])), 30)]
    a = _loader(remote["url"])
    first = [batch_ids(b) for b in itertools.islice(iter(a), 11)]
    b = _loader(remote["url"])
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert first + [batch_ids(x) for x in itertools.islice(iter(b), 19)] == ref
    fp = dataset_fingerprint(DatasetConfig(dataset_path=remote["url"]))
    assert [name for name, _ in fp[0]] == [f"part-{i}.parquet" for i in range(3)]  # README skipped


def test_url_glob_and_errors(remote):
    cfg = DatasetConfig(dataset_path=remote["url"] + "/part-[02].parquet", packing_length=24,
                        num_epochs=1)  # fmt: skip
    ids = {i for b in build_dataloader(cfg, id_processor, num_workers=0) for i in batch_ids(b)}
    assert ids == set(range(50)) | set(range(100, 150))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _loader(remote["url"] + "/nothing")
    with pytest.raises(ValueError, match="only Parquet streams from a URL"):
        build_dataloader(DatasetConfig(dataset_path=remote["url"], dataset_format="jsonl"),
                         id_processor, num_workers=0)  # fmt: skip


def test_dataset_path_exists(remote, tmp_path):
    """What the trainer's preflight asks of a dataset_path entry (URL, folder, recursive glob)."""
    from lmms_data import dataset_path_exists

    assert dataset_path_exists(remote["url"]) and dataset_path_exists(remote["url"] + "/*.parquet")
    assert not dataset_path_exists(remote["url"] + "/nothing")
    assert dataset_path_exists(str(tmp_path / "**" / "part-1.parquet"))  # ** spans folders
    assert not dataset_path_exists(str(tmp_path / "**" / "part-9.parquet"))
