"""Demo data for the diffusion families: coloured shapes with class labels (SiT) and short clips
of a moving shape with captions (Wan), deterministic from a seed, written as Parquet."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

__all__ = ["SHAPES", "generate_synthetic_clips", "generate_synthetic_shapes"]

SHAPES = ("circle", "square", "triangle", "cross")  # class label = index
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220),
           "yellow": (230, 200, 40)}  # fmt: skip


def _draw(d: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = r / 3
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)


def _frame(shape: str, colour: str, cx: float, cy: float, r: float, size: int) -> Image.Image:
    img = Image.new("RGB", (size, size), (16, 16, 16))
    _draw(ImageDraw.Draw(img), shape, cx, cy, r, COLOURS[colour])
    return img


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def generate_synthetic_shapes(
    out_dir: str, n: int, *, seed: int = 0, image_size: int = 32, rows_per_group: int = 64
) -> str:
    """``n`` records ``{"image": PNG bytes, "label": shape index}``: one shape of a random colour,
    centre and size; the class is the shape (4 classes). Returns the Parquet file's path."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        label = int(rng.integers(len(SHAPES)))
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        r = image_size * rng.uniform(0.22, 0.32)
        cx, cy = rng.uniform(r, image_size - r, size=2)
        img = _frame(SHAPES[label], colour, cx, cy, r, image_size)
        rows.append({"image": _png(img), "label": label})
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "shapes.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=rows_per_group)
    return path


def generate_synthetic_clips(
    out_dir: str, n: int, *, seed: int = 0, size: int = 32, frames: int = 9, fps: int = 8
) -> str:
    """``n`` records ``{"video": "clips/<i>.mp4", "caption": "a red circle moving left"}``: a
    shape crossing the frame in one of 4 directions. Needs PyAV (``lmms-data[video]``)."""
    try:
        import av
    except ImportError:
        raise ImportError("synthetic clips need PyAV: pip install 'lmms-data[video]'") from None
    rng = np.random.default_rng(seed)
    clips = os.path.join(out_dir, "clips")
    os.makedirs(clips, exist_ok=True)
    moves = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}
    rows = []
    for i in range(n):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        move = list(moves)[int(rng.integers(len(moves)))]
        r = size * 0.2
        (dx, dy), start = moves[move], rng.uniform(r, size - r, size=2)
        travel = np.linspace(-0.3, 0.3, frames) * size
        rel = f"clips/{i:05d}.mp4"
        with av.open(os.path.join(out_dir, rel), "w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width = stream.height = size
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "10"}
            for t in travel:
                cx = float(np.clip(start[0] + dx * t, r, size - r))
                cy = float(np.clip(start[1] + dy * t, r, size - r))
                img = _frame(shape, colour, cx, cy, r, size)
                for packet in stream.encode(av.VideoFrame.from_image(img)):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        rows.append({"video": rel, "caption": f"a {colour} {shape} moving {move}"})
    path = os.path.join(out_dir, "clips.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
