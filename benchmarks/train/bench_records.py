"""The benchmark's synthetic records, in lmms-data's Parquet layout (bench_train.py's data).

One image per VL sample, square sides drawn from 224-672 px (a few distinct JPEGs per size, so
decoding cost stays real); text lengths long-tailed (lognormal, median ~250 tokens, capped at
4k). Deterministic for a seed: every run of a case, lmms or plain transformers, sees the same
records.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

WORDS = [
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was",
    "by", "at", "from", "this", "be", "are", "or", "an", "which", "one", "image", "shows",
    "red", "blue", "green", "circle", "square", "triangle", "large", "small", "left", "right",
    "top", "bottom", "count", "there", "two", "three", "four", "colour", "shape", "next",
    "under", "above", "between", "object", "picture", "describe", "answer"
]  # fmt: skip


def make_records(n: int, seed: int, *, images: bool, tiny: bool) -> list[dict]:
    """Records in lmms-data's Parquet layout: `messages` (JSON) + `images` (list of JPEG bytes)."""
    from PIL import Image

    rng = random.Random(seed)
    sides = [56, 84] if tiny else [224, 336, 448, 560, 672]
    cache: dict[tuple[int, int], bytes] = {}
    out = []
    for i in range(n):
        n_txt = min(64 if tiny else 4096, int(rng.lognormvariate(3.0 if tiny else 5.5, 0.9))) + 8
        words = [rng.choice(WORDS) for _ in range(max(2, int(n_txt / 1.6)))]
        cut = max(1, len(words) // 5)
        q, a = " ".join(words[:cut]), " ".join(words[cut:])
        user = [{"type": "text", "text": q}]
        rec: dict = {}
        if images:
            side = rng.choice(sides)
            key = (side, i % 8)  # a few distinct images per size: decoding cost stays real
            if key not in cache:
                img = Image.effect_noise((side, side), 64).convert("RGB")
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=85)
                cache[key] = buf.getvalue()
            user = [{"type": "image"}, *user]
            rec["images"] = [cache[key]]
        rec["messages"] = json.dumps(
            [
                {"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": a}]},
            ]
        )
        out.append(rec)
    return out


def write_parquet(records: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    cols = {"messages": [r["messages"] for r in records]}
    if "images" in records[0]:
        cols["images"] = pa.array([r["images"] for r in records], type=pa.list_(pa.binary()))
    pq.write_table(pa.table(cols), path, row_group_size=64)
