"""Every reader yields the same records; units split; positions resume mid-unit; read_at."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pyarrow as pa
import pyarrow.feather as feather
import pytest
from lmms_data_testutil import id_record, write_id_jsonl, write_id_parquet

from lmms_data import discover_units, iter_unit
from lmms_data._readers import decode_raw, read_at

N = 37


def _ids(path, fmt=None, min_units=1):
    out = []
    for u in discover_units(path, fmt, min_units):
        for p, _, raw in iter_unit(u):
            rec = decode_raw(u, p, 0, raw)
            msgs = rec["messages"]
            msgs = json.loads(msgs) if isinstance(msgs, str) else msgs
            out.append(int(msgs[0]["content"][0]["text"].split()[1]))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("readers")
    ids = list(range(N))
    p = {}
    p["jsonl"] = write_id_jsonl(str(d / "a.jsonl"), ids)
    with open(p["jsonl"], "rb") as f, gzip.open(d / "a.jsonl.gz", "wb") as g:
        g.write(f.read())
    p["gz"] = str(d / "a.jsonl.gz")
    p["parquet"] = write_id_parquet(str(d / "a.parquet"), ids, rows_per_group=8)
    table = pa.table({"messages": [json.dumps(id_record(i)["messages"]) for i in ids]})
    p["feather"] = str(d / "a.feather")
    feather.write_feather(table, p["feather"], chunksize=10)
    p["arrow_stream"] = str(d / "s.arrow")
    with pa.OSFile(p["arrow_stream"], "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=9):
            w.write_batch(b)
    os.makedirs(d / "dir")
    write_id_parquet(str(d / "dir" / "x-0.parquet"), ids[:20])
    write_id_parquet(str(d / "dir" / "x-1.parquet"), ids[20:])
    p["dir"] = str(d / "dir")
    p["json_array"] = str(d / "arr.json")  # one JSON array (LLaVA / ShareGPT files), pretty-printed
    with open(p["json_array"], "w") as f:
        json.dump([id_record(i) for i in ids], f, indent=2)
    p["json_array_gz"] = str(d / "arr.json.gz")  # the same array, gzip-compressed
    with open(p["json_array"], "rb") as f, gzip.open(p["json_array_gz"], "wb") as g:
        g.write(f.read())
    p["glob"] = str(d / "dir" / "x-*.parquet")
    return p


@pytest.mark.parametrize(
    "key",
    [
        "jsonl",
        "gz",
        "parquet",
        "feather",
        "arrow_stream",
        "dir",
        "glob",
        "json_array",
        "json_array_gz",
    ],
)
@pytest.mark.parametrize("min_units", [1, 6])
def test_every_reader_yields_all_records_once(shards, key, min_units):
    assert sorted(_ids(shards[key], None, min_units)) == list(range(N))


def test_hf_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(
        [{"messages": json.dumps(id_record(i)["messages"])} for i in range(N)]
    )
    ds.save_to_disk(str(tmp_path / "hf"))
    assert sorted(_ids(str(tmp_path / "hf"))) == list(range(N))
    assert sorted(_ids(str(tmp_path / "hf"), "hf", 5)) == list(range(N))


def test_jsonl_byte_ranges_and_resume(shards, monkeypatch):
    import lmms_data._readers as r

    monkeypatch.setattr(r, "JSONL_CHUNK_BYTES", 331)  # many byte-range units, lines cut across them
    units = discover_units(shards["jsonl"], None, 1)
    assert len(units) > 5
    assert sorted(_ids(shards["jsonl"])) == list(range(N))
    u = units[2]
    items = list(iter_unit(u))
    assert items
    p, q, _ = items[0]
    rest = list(iter_unit(u, q))  # resume after the first record
    assert [x[0] for x in rest] == [x[0] for x in items[1:]]
    assert read_at(u, [p])[p] == items[0][2]


@pytest.mark.parametrize("key", ["parquet", "gz", "feather", "json_array", "json_array_gz"])
def test_resume_mid_unit_and_read_at(shards, key):
    u = discover_units(shards[key], None, 1)[0]
    items = list(iter_unit(u))
    rest = list(iter_unit(u, items[3][1]))
    assert [x[0] for x in rest] == [x[0] for x in items[4:]]
    got = read_at(u, [items[1][0], items[5][0]])
    assert got[items[5][0]] == items[5][2]


def test_format_override_and_errors(shards, tmp_path):
    shutil.copy(shards["jsonl"], tmp_path / "data.txt")
    with pytest.raises(ValueError, match="dataset_format"):
        discover_units(str(tmp_path / "data.txt"), None, 1)
    assert sorted(_ids(str(tmp_path / "data.txt"), "jsonl")) == list(range(N))
    with pytest.raises(FileNotFoundError):
        discover_units(str(tmp_path / "nope.parquet"), None, 1)
