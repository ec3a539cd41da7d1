"""Synthetic preference pairs for DPO demos and tests: the coloured-shapes pictures of
``generate_synthetic_vl`` with a question, the right answer (chosen) and a wrong one (rejected).

The rejected answer keeps the chosen one's template and changes its facts (another count, another
colour or shape), so a model can only prefer the chosen answer by looking at the picture: the
reward accuracy of a DPO run rises as it learns to.
"""

from __future__ import annotations

import json
import os

import numpy as np

from lmms_data._synthetic import COLOURS, NUMBERS, SHAPES, synthetic_records

__all__ = ["generate_synthetic_preference"]


def _corrupt(answer: str, rng: np.random.Generator) -> str:
    """The answer with one fact changed (a number, colour or shape word replaced)."""
    words = answer.rstrip(".").split(" ")
    vocab = [list(NUMBERS), list(COLOURS), list(SHAPES)]
    spots = [
        (i, group) for i, w in enumerate(words) for group in vocab if w.lower() in group
    ]  # fmt: skip
    i, group = spots[int(rng.integers(len(spots)))]
    word = words[i].lower()
    other = [w for w in group if w != word][int(rng.integers(len(group) - 1))]
    words[i] = other.capitalize() if words[i][0].isupper() else other
    return " ".join(words) + "."


def generate_synthetic_preference(
    out_dir: str, n: int, *, seed: int = 0, image_size: int = 64
) -> list[str]:
    """Write ``n`` preference records (Parquet: ``prompt`` as a JSON message list with one image
    part, ``chosen`` and ``rejected`` strings, ``images`` PNG bytes) to ``out_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng([seed, 0xD0])
    prompts, chosen, rejected, images = [], [], [], []
    for q, a, png in synthetic_records(n, seed=seed, image_size=image_size):
        prompts.append(json.dumps([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": q}]}]))  # fmt: skip
        chosen.append(a)
        rejected.append(_corrupt(a, rng))
        images.append([png])
    table = pa.table({
        "prompt": prompts, "chosen": chosen, "rejected": rejected,
        "images": pa.array(images, type=pa.list_(pa.binary())),
    })  # fmt: skip
    path = os.path.join(out_dir, "shard-00000.parquet")
    pq.write_table(table, path, row_group_size=64)
    return [path]
