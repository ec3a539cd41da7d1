"""Small synthetic datasets a tiny model can learn: coloured shapes (vision-language) and text.

``generate_synthetic_vl``: each record shows 1-4 shapes (circle, square, triangle) in one of six
colours and asks either to describe the picture or to count shapes (of one colour, or all).
``generate_synthetic_text``: text-only chat records (single-digit sums, copying and reversing short
word lists) for the text model families. Answers follow fixed templates, so a small model drives
the loss well below the unigram baseline within a few hundred steps.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (235, 200, 20), "purple": (140, 50, 170), "orange": (245, 130, 20)}  # fmt: skip
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("zero", "one", "two", "three", "four", "five")


def _draw(rng: np.random.Generator, size: int) -> tuple[Image.Image, list[tuple[str, str]]]:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    n = int(rng.integers(1, 5))
    cells = rng.permutation(4)[:n]  # one shape per quadrant: no overlaps
    objs = []
    for c in cells.tolist():
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        h = size // 2
        x0, y0 = (c % 2) * h, (c // 2) * h
        r = int(h * rng.uniform(0.25, 0.4))
        cx, cy = x0 + h // 2, y0 + h // 2
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            d.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            d.rectangle(box, fill=COLOURS[colour])
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
        objs.append((colour, shape))
    return img, objs


def _qa(rng: np.random.Generator, objs: list[tuple[str, str]]) -> tuple[str, str]:
    kind = int(rng.integers(3))
    if kind == 0:
        desc = ", ".join(f"a {c} {s}" for c, s in objs)
        return "Describe the image.", f"There {'is' if len(objs) == 1 else 'are'} {desc}."
    if kind == 1:
        return "How many shapes are there?", f"There are {NUMBERS[len(objs)]} shapes."
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    n = sum(c == colour for c, _ in objs)
    return f"How many {colour} shapes are there?", f"{NUMBERS[n].capitalize()}."


def synthetic_records(n: int, *, seed: int = 0, image_size: int = 64):
    """Yield ``(question, answer, png_bytes)`` triples, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        img, objs = _draw(rng, image_size)
        q, a = _qa(rng, objs)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        yield q, a, buf.getvalue()


def _messages(q: str, a: str, image: object) -> list[dict]:
    img_part = {"type": "image"} if image is None else {"type": "image", "image": image}
    return [
        {"role": "user", "content": [img_part, {"type": "text", "text": q}]},
        {"role": "assistant", "content": [{"type": "text", "text": a}]},
    ]


def generate_synthetic_vl(
    out_dir: str,
    n: int,
    format: str = "parquet",
    seed: int = 0,
    *,
    image_size: int = 64,
    num_shards: int = 1,
    rows_per_group: int = 64,
) -> list[str]:
    """Write ``n`` records to ``out_dir`` and return the shard paths.

    ``parquet``: columns ``messages`` (JSON string) and ``images`` (list of PNG bytes), row groups
    of ``rows_per_group``. ``jsonl``: one line per record, images as PNG files under
    ``out_dir/images`` referenced by relative path (set ``data_folder`` to ``out_dir``).
    """
    os.makedirs(out_dir, exist_ok=True)
    recs = list(synthetic_records(n, seed=seed, image_size=image_size))
    bounds = np.linspace(0, n, num_shards + 1).astype(int)
    paths = []
    if format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for s in range(num_shards):
            part = recs[bounds[s] : bounds[s + 1]]
            table = pa.table({
                "messages": [json.dumps(_messages(q, a, None)) for q, a, _ in part],
                "images": pa.array([[b] for _, _, b in part], type=pa.list_(pa.binary())),
            })  # fmt: skip
            path = os.path.join(out_dir, f"shard-{s:05d}.parquet")
            pq.write_table(table, path, row_group_size=rows_per_group)
            paths.append(path)
    elif format == "jsonl":
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
        for s in range(num_shards):
            path = os.path.join(out_dir, f"shard-{s:05d}.jsonl")
            with open(path, "w") as f:
                for i in range(bounds[s], bounds[s + 1]):
                    q, a, b = recs[i]
                    rel = f"images/{i:07d}.png"
                    with open(os.path.join(out_dir, rel), "wb") as g:
                        g.write(b)
                    f.write(json.dumps({"messages": _messages(q, a, rel)}) + "\n")
            paths.append(path)
    else:
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {format!r}")
    return paths


WORDS = ("red", "green", "blue", "yellow", "circle", "square", "star", "one", "two", "three")


def text_records(n: int, *, seed: int = 0):
    """Yield ``(question, answer)`` pairs of three templated tasks, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        kind = int(rng.integers(3))
        if kind == 0:
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
            yield f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
            continue
        words = [WORDS[int(i)] for i in rng.integers(len(WORDS), size=int(rng.integers(2, 6)))]
        if kind == 1:
            yield f"Repeat: {' '.join(words)}", " ".join(words)
        else:
            yield f"Reverse: {' '.join(words)}", " ".join(reversed(words))


def generate_synthetic_text(
    out_dir: str, n: int, format: str = "parquet", seed: int = 0, *, num_shards: int = 1,
    rows_per_group: int = 64,
) -> list[str]:  # fmt: skip
    """Write ``n`` text-only chat records to ``out_dir`` and return the shard paths.

    ``parquet``: one ``messages`` column (JSON string), row groups of ``rows_per_group``.
    ``jsonl``: one ``{"messages": [...]}`` per line.
    """
    if format not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {format!r}")
    os.makedirs(out_dir, exist_ok=True)
    msgs = [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for q, a in text_records(n, seed=seed)
    ]
    bounds = np.linspace(0, n, num_shards + 1).astype(int)
    paths = []
    for s in range(num_shards):
        part = msgs[bounds[s] : bounds[s + 1]]
        path = os.path.join(out_dir, f"shard-{s:05d}.{format}")
        if format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({"messages": [json.dumps(m) for m in part]})
            pq.write_table(table, path, row_group_size=rows_per_group)
        else:
            with open(path, "w") as f:
                f.writelines(json.dumps({"messages": m}) + "\n" for m in part)
        paths.append(path)
    return paths
