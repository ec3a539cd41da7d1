"""Helpers shared by the lmms-data tests (imported by name; conftest puts this folder on sys.path)."""

from __future__ import annotations

import json
import os

import numpy as np


def id_record(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": f"id {i}"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        ]
    }


def id_processor(messages: list) -> dict:
    """Text-only stub processor: the record id becomes the tokens; length 1 + id % 7."""
    i = int(messages[0]["content"][0]["text"].split()[1])
    n = 1 + i % 7
    ids = np.full(n, i, dtype=np.int64)
    return {"input_ids": ids, "labels": ids.copy(), "length": n}


def write_id_jsonl(path: str, ids) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i in ids:
            f.write(json.dumps(id_record(i)) + "\n")
    return path


def write_id_parquet(path: str, ids, rows_per_group: int = 10) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    msgs = [json.dumps(id_record(i)["messages"]) for i in ids]
    pq.write_table(pa.table({"messages": msgs}), path, row_group_size=rows_per_group)
    return path


def batch_ids(batch: dict) -> list[int]:
    """Record ids of the samples in a packed batch built from id_processor samples."""
    cu = batch["cu_seqlens"].tolist()
    ids = batch["input_ids"]
    return [int(ids[a]) for a in cu[:-1]]
