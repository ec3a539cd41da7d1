"""3-D mRoPE positions for Qwen-VL samples, in numpy (no model instance on the data path).

Mirrors ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index`` of transformers 5.x for
one unpadded sample: consecutive runs of text tokens get ``arange`` positions on all three axes;
each run of media tokens gets (t, h, w) grid positions offset by the current position, after which
the position advances by ``max(h, w) // merge``. Qwen2.5-VL spaces video time by
``tokens_per_second * second_per_grid_t``; Qwen3-VL splits a video into one grid per temporal
patch (each frame group is its own run, separated by timestamp text) with no temporal scaling.
Parity with the upstream method is tested in tests/test_processors.py.
"""

from __future__ import annotations

import numpy as np


def _vision_positions(start: int, grid: np.ndarray, merge: int, time_interval: float) -> np.ndarray:
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    # torch: (arange(t) * interval) in float32, truncated to int64
    pt = (np.arange(t, dtype=np.float32) * np.float32(time_interval)).astype(np.int64) + start
    ph = np.arange(h, dtype=np.int64) + start
    pw = np.arange(w, dtype=np.int64) + start
    tt, hh, ww = np.meshgrid(pt, ph, pw, indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)])  # [3, t*h*w]


def mrope_positions(
    token_types: np.ndarray,  # [L] 0 text, 1 image, 2 video
    image_grid_thw: np.ndarray | None,  # [n_img, 3]
    video_grid_thw: np.ndarray | None,  # [n_vid, 3]
    *,
    merge: int,
    family: str,
    second_per_grid_ts: list[float] | None = None,
    tokens_per_second: float = 2.0,
) -> np.ndarray:  # [3, L] int64
    grids: dict[int, list[np.ndarray]] = {1: [], 2: []}
    if image_grid_thw is not None:
        grids[1] = list(image_grid_thw)
    intervals: list[float] = []
    if video_grid_thw is not None:
        if family == "qwen3_vl":
            for g in video_grid_thw:
                grids[2] += [np.array([1, g[1], g[2]])] * int(g[0])
            intervals = [1.0] * len(grids[2])
        else:
            grids[2] = list(video_grid_thw)
            spg = second_per_grid_ts or [1.0] * len(grids[2])
            intervals = [tokens_per_second * s for s in spg]
    L = len(token_types)
    out = np.empty((3, L), dtype=np.int64)
    change = np.flatnonzero(np.diff(token_types)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [L]])
    pos, used = 0, {1: 0, 2: 0}
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        kind = int(token_types[a])
        if kind == 0:
            out[:, a:b] = np.arange(pos, pos + b - a)
            pos += b - a
            continue
        k = used[kind]
        used[kind] += 1
        g = grids[kind][k]
        interval = intervals[k] if kind == 2 else 1.0
        vp = _vision_positions(pos, g, merge, interval)
        if vp.shape[1] != b - a:
            raise ValueError(f"media run of {b - a} tokens does not match grid {g.tolist()}")
        out[:, a:b] = vp
        pos += max(int(g[1]), int(g[2])) // merge
    return out
