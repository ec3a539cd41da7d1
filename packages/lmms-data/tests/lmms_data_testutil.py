"""Helpers shared by the lmms-data tests (imported by name; conftest puts this folder on sys.path)."""

from __future__ import annotations

import io
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


def ids_over_ranks(cfg, world: int, num_workers: int) -> list[int]:
    """Record ids of every batch of ``world`` ranks' loaders of ``cfg`` (``id_processor``
    samples), rank after rank."""
    from lmms_data import build_dataloader

    ids = []
    for rank in range(world):
        loader = build_dataloader(
            cfg, id_processor, dp_rank=rank, dp_world=world, num_workers=num_workers
        )
        ids += [i for batch in loader for i in batch_ids(batch)]
    return ids


def random_png(h: int, w: int, seed: int = 0) -> bytes:
    """A PNG of h x w random RGB pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def random_video(path, *, n: int, h: int, w: int, fps: int = 4) -> str:
    """An mpeg4 file of `n` random h x w frames at `fps` (skips the test without PyAV)."""
    import pytest

    av = pytest.importorskip("av")
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(n):
            frame = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            c.mux(s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        c.mux(s.encode())
    return str(path)
