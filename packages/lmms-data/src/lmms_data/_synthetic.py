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


#: per media kind: the parquet column, the jsonl media folder and the files' extension
_MEDIA = {"image": ("images", "images", "png"), "audio": ("audios", "audio", "wav")}


def _messages(q: str, a: str, kind: str, media: object) -> list[dict]:
    part = {"type": kind} if media is None else {"type": kind, kind: media}
    return [
        {"role": "user", "content": [part, {"type": "text", "text": q}]},
        {"role": "assistant", "content": [{"type": "text", "text": a}]},
    ]


def write_shards(
    out_dir: str, recs: list, kind: str, format: str, num_shards: int, rows_per_group: int
) -> list[str]:
    """``(question, answer, media bytes)`` records of one media ``kind`` ("image", "audio") as
    ``num_shards`` shards of ``out_dir``; returns their paths. ``parquet``: columns ``messages``
    (JSON string) and the media column (a list of bytes per row), row groups of
    ``rows_per_group``. ``jsonl``: one line per record, the media as files under a folder of
    ``out_dir`` referenced by relative path (set ``data_folder`` to ``out_dir``)."""
    if format not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {format!r}")
    column, folder, ext = _MEDIA[kind]
    bounds = np.linspace(0, len(recs), num_shards + 1).astype(int)
    paths = []
    for s in range(num_shards):
        part = recs[bounds[s] : bounds[s + 1]]
        path = os.path.join(out_dir, f"shard-{s:05d}.{format}")
        if format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({
                "messages": [json.dumps(_messages(q, a, kind, None)) for q, a, _ in part],
                column: pa.array([[b] for _, _, b in part], type=pa.list_(pa.binary())),
            })  # fmt: skip
            pq.write_table(table, path, row_group_size=rows_per_group)
        else:
            os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
            with open(path, "w") as f:
                for i, (q, a, b) in enumerate(part, start=int(bounds[s])):
                    rel = f"{folder}/{i:07d}.{ext}"
                    with open(os.path.join(out_dir, rel), "wb") as g:
                        g.write(b)
                    f.write(json.dumps({"messages": _messages(q, a, kind, rel)}) + "\n")
        paths.append(path)
    return paths


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
    """Write ``n`` coloured-shape records to ``out_dir`` and return the shard paths (images as
    PNG; the layout: :func:`write_shards`)."""
    os.makedirs(out_dir, exist_ok=True)
    recs = list(synthetic_records(n, seed=seed, image_size=image_size))
    return write_shards(out_dir, recs, "image", format, num_shards, rows_per_group)


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
