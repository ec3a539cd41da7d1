"""Demo data for BAGEL (unified understanding and generation): shapes with captions as chat records.

Each record shows one centred shape (circle or square) of one colour (red, green, blue) on white
and is one of three kinds, in the messages format of docs/data.md:

* *understanding*: user = image + "what is this?", assistant = "a red square" (cross-entropy);
* *generation*: user = "draw a red square", assistant = the image (flow matching);
* *editing*: user = image + "make it blue", assistant = the same shape in blue (flow matching on
  the output, the input given to the model both as ViT tokens and as clean latents).

Captions follow one template, so a tiny model learns both objectives within a minute on CPU.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
from PIL import Image, ImageDraw

from lmms_data._synthetic_kinds import register_synthetic_kind

__all__ = [
    "BAGEL_COLOURS",
    "BAGEL_SHAPES",
    "bagel_records",
    "generate_synthetic_bagel",
    "shape_png",
]

BAGEL_COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (40, 70, 220)}
BAGEL_SHAPES = ("square", "circle")
KINDS = ("understanding", "generation", "editing")


def shape_png(colour: str, shape: str, size: int = 32) -> bytes:
    """A ``size x size`` PNG: one centred ``shape`` filled with ``colour`` on white."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    m = max(1, size * 3 // 16)
    box = (m, m, size - m, size - m)
    draw = ImageDraw.Draw(img)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=BAGEL_COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def bagel_records(
    n: int, *, seed: int = 0, image_size: int = 32, kinds: tuple[str, ...] = KINDS,
    weights: tuple[float, ...] | None = None,
):  # fmt: skip
    """Yield ``(messages with image placeholders, [PNG bytes in placeholder order])``."""
    rng = np.random.default_rng(seed)
    colours = list(BAGEL_COLOURS)
    p = None if weights is None else np.asarray(weights, dtype=np.float64) / sum(weights)
    for _ in range(n):
        kind = kinds[int(rng.choice(len(kinds), p=p))]
        colour = colours[int(rng.integers(len(colours)))]
        shape = BAGEL_SHAPES[int(rng.integers(len(BAGEL_SHAPES)))]
        img = {"type": "image"}
        if kind == "understanding":
            msgs = [{"role": "user", "content": [img, {"type": "text", "text": "what is this?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape}"}]}]  # fmt: skip
            yield msgs, [shape_png(colour, shape, image_size)]
        elif kind == "generation":
            msgs = [{"role": "user", "content": [{"type": "text", "text": f"draw a {colour} {shape}"}]},
                    {"role": "assistant", "content": [img]}]  # fmt: skip
            yield msgs, [shape_png(colour, shape, image_size)]
        else:
            other = colours[(colours.index(colour) + 1 + int(rng.integers(2))) % 3]
            msgs = [{"role": "user", "content": [img, {"type": "text", "text": f"make it {other}"}]},
                    {"role": "assistant", "content": [img]}]  # fmt: skip
            yield msgs, [shape_png(colour, shape, image_size), shape_png(other, shape, image_size)]


def generate_synthetic_bagel(
    out_dir: str, n: int, *, seed: int = 0, image_size: int = 32, rows_per_group: int = 64,
    weights: tuple[float, ...] | None = (0.45, 0.45, 0.1),
) -> str:  # fmt: skip
    """Write ``n`` records (see the module docstring; ``weights``: the understanding / generation
    / editing mix) to ``out_dir/shard-00000.parquet`` (columns ``messages``: JSON, ``images``: list
    of PNG bytes filling the image parts in order) and return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    recs = list(bagel_records(n, seed=seed, image_size=image_size, weights=weights))
    table = pa.table({
        "messages": [json.dumps(m) for m, _ in recs],
        "images": pa.array([imgs for _, imgs in recs], type=pa.list_(pa.binary())),
    })  # fmt: skip
    path = os.path.join(out_dir, "shard-00000.parquet")
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


@register_synthetic_kind("bagel")
def _bagel_kind(out: str, n: int, *, format: str, seed: int, image_size: int) -> None:
    del format  # always Parquet: the images ride in a binary list column
    generate_synthetic_bagel(out, n, seed=seed, image_size=image_size)
