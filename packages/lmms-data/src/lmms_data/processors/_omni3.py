"""Qwen3-Omni-MoE thinker samples: Qwen2.5-Omni's layout (chat messages with text, image, video
and audio parts; placeholders bracketed by vision / audio markers; ``[4, L]`` TMRoPE positions)
with Qwen3-Omni's own rules, each equal to upstream's (transformers 5.17 and 5.24 alike):

* clip to tokens: every ``2·n_window``-frame chunk (and the remainder) through three stride-2
  convolutions (``13`` tokens per full 100-frame chunk);
* ``use_audio_in_video``: ``<|audio_bos|>`` + the video's and its sound track's tokens
  interleaved one by one in TMRoPE time + ``<|audio_eos|>`` inside the video's vision markers.
  A video token of temporal patch ``t`` goes before the audio token ``k`` while
  ``t · second_per_grid · position_id_per_seconds <= k`` (the processor's float64 rule);
* positions (:func:`omni3_positions`) are **fractional**: video time is
  ``t · second_per_grid · position_id_per_seconds`` kept as a float32 (not truncated as in
  Qwen2.5-Omni), and everything after such a block continues one past its largest (fractional)
  position, exactly as ``Qwen3OmniMoeThinkerModel.get_rope_index`` computes them in float32.
  ``position_ids`` is therefore a float32 ``[4, L]`` array (row 0 the per-sample text positions).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmms_data._local_processor import register_local_processor
from lmms_data._registry import register_processor
from lmms_data.processors._omni import Qwen2_5OmniDataProcessor

__all__ = ["Qwen3OmniMoeDataProcessor", "omni3_audio_tokens", "omni3_positions"]

_F32 = np.float32


def omni3_audio_tokens(frames: np.ndarray, n_window: int = 50) -> np.ndarray:
    """Qwen3-Omni audio-encoder outputs per clip of ``frames [n]`` mel frames."""
    frames = np.asarray(frames, dtype=np.int64)
    chunk = 2 * n_window

    def down(n: np.ndarray) -> np.ndarray:  # three stride-2 convolutions, kernel 3, padding 1
        for _ in range(3):
            n = (n - 1) // 2 + 1
        return n

    rest = frames % chunk
    return np.where(rest > 0, down(rest), 0) + (frames // chunk) * down(np.int64(chunk))


def _video_times(grid_t: int, second_per_grid: float, per_second: float) -> np.ndarray:
    """TMRoPE time per temporal patch in float32, in torch's operation order:
    ``(t · float32(second_per_grid)) · per_second``."""
    t = np.arange(grid_t, dtype=_F32) * _F32(second_per_grid)
    return t * _F32(per_second)  # [grid_t]


def _vision(start: Any, times: np.ndarray, grid: np.ndarray, merge: int) -> np.ndarray:
    """``[3, t·h·w]`` float32 (time, row, column) positions of one grid offset by ``start``."""
    h, w = int(grid[1]) // merge, int(grid[2]) // merge
    tt, hh, ww = np.meshgrid(times, np.arange(h, dtype=_F32), np.arange(w, dtype=_F32),
                             indexing="ij")  # fmt: skip
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + _F32(start)


def _run(n: int, start: Any) -> np.ndarray:
    """``[3, n]`` positions ``start + k`` (text, markers, audio)."""
    return np.broadcast_to(np.arange(n, dtype=_F32) + _F32(start), (3, n))


def interleave_audio_video(video_keys: np.ndarray, audio_keys: np.ndarray) -> np.ndarray:
    """Order of a video's tokens and its sound track's: ``[n_video + n_audio]`` booleans, True
    for a video token. The next video token goes first while its key is ``<=`` the next audio
    token's; once one side is used up, the other side's rest follows (upstream's merge)."""
    out, v, a = [], 0, 0
    while v < len(video_keys) and a < len(audio_keys):
        take_video = bool(video_keys[v] <= audio_keys[a])
        out.append(take_video)
        v, a = v + take_video, a + (not take_video)
    out += [True] * (len(video_keys) - v) + [False] * (len(audio_keys) - a)
    return np.asarray(out, dtype=bool)


def _tail(order: np.ndarray) -> int:
    """Length of the run of equal values ending ``order``: the side left after the other was
    used up (never empty: the merge stops when one side runs out)."""
    changes = np.flatnonzero(order != order[-1])
    return len(order) - (int(changes[-1]) + 1 if len(changes) else 0)


def omni3_positions(
    ids: np.ndarray,  # [L]
    *,
    tokens: dict[str, int],  # image, video, audio, vision_bos, vision_eos, audio_bos, audio_eos
    image_grid_thw: np.ndarray | None,
    video_grid_thw: np.ndarray | None,
    audio_tokens: list[int],  # tokens per audio block, in order (videos' sound tracks included)
    second_per_grid: list[float],
    merge: int,
    per_second: float = 13,
) -> np.ndarray:  # [3, L] float32
    """Qwen3-Omni TMRoPE positions of one sample (see the module docstring), in float32.

    Text, markers and audio advance one position per token; a block's opening marker(s) (two
    for a video with its sound) start one past the previous piece's largest position, its
    content one past them; the end marker(s) continue one past the largest position of the last
    piece placed (for an interleaved block the tail left after the merge, see
    :func:`interleave_audio_video`, whose keys here are the offset float32 positions)."""
    L = len(ids)
    out = np.empty((3, L), dtype=_F32)
    last: np.float32 | None = None  # the largest position of the last piece placed
    n_img = n_vid = n_aud = 0
    i = text_from = 0
    while True:
        tok = int(ids[i]) if i < L else -1
        nxt = int(ids[i + 1]) if i + 1 < L else -1
        opens = tok == tokens["audio_bos"] or (
            tok == tokens["vision_bos"]
            and nxt in (tokens["image"], tokens["video"], tokens["audio_bos"])
        )
        if i < L and not opens:
            i += 1
            continue
        st = _F32(0) if last is None else last + _F32(1)
        if i > text_from:  # the text before the block (or the tail of the sample)
            out[:, text_from:i] = _run(i - text_from, st)
            last, st = st + _F32(i - text_from - 1), st + _F32(i - text_from)
        if i == L:
            return out
        bos = 2 if tok == tokens["vision_bos"] and nxt == tokens["audio_bos"] else 1
        out[:, i : i + bos] = _run(bos, st)
        st = st + _F32(bos)
        if tok == tokens["audio_bos"]:
            block = last_piece = _run(audio_tokens[n_aud], st)
            n_aud += 1
        elif nxt == tokens["image"]:
            grid = image_grid_thw[n_img]
            times = np.arange(int(grid[0]), dtype=_F32) * _F32(per_second)
            block = last_piece = _vision(st, times, grid, merge)
            n_img += 1
        else:  # a video, alone or with its sound track
            grid = video_grid_thw[n_vid]
            times = _video_times(int(grid[0]), second_per_grid[n_vid], per_second)
            block = last_piece = _vision(st, times, grid, merge)
            n_vid += 1
            if bos == 2:
                aud = _run(audio_tokens[n_aud], st)
                order = interleave_audio_video(block[0], aud[0])
                merged = np.empty((3, len(order)), dtype=_F32)
                merged[:, order], merged[:, ~order] = block, aud
                block, last_piece = merged, merged[:, len(order) - _tail(order) :]
                n_aud += 1
        n = block.shape[1]
        out[:, i + bos : i + bos + n] = block
        st = last_piece.max() + _F32(1)
        out[:, i + bos + n : i + 2 * bos + n] = _run(bos, st)
        last = st + _F32(bos - 1)
        i = text_from = i + 2 * bos + n


@register_processor("qwen3_omni_moe")
class Qwen3OmniMoeDataProcessor(Qwen2_5OmniDataProcessor):
    """Options: Qwen2.5-Omni's (``use_audio_in_video``; ``position_id_per_seconds``, default 13
    as Qwen3-Omni's processor, must equal the model config's) and ``audio_n_window`` (50: the
    audio config's ``n_window``). ``seconds_per_chunk`` is not used (the interleaving is per
    token)."""

    family = "qwen3_omni_moe"

    def __init__(self, processor: Any, **options: Any) -> None:
        self.n_window = int(options.pop("audio_n_window", 50))
        options.setdefault("position_id_per_seconds", 13)
        super().__init__(processor, **options)

    def audio_tokens(self, frames: np.ndarray) -> np.ndarray:
        return omni3_audio_tokens(frames, self.n_window)

    def _video_fill(self, grid: np.ndarray, spg: float, n_audio: int | None) -> str:
        """The video's placeholders; with its sound track, upstream's per-token interleaving
        (keys in float64: ``t · second_per_grid · position_id_per_seconds`` against the audio
        token index)."""
        n_vid = int(grid.prod()) // self.merge**2
        if n_audio is None:
            return self.video_token * n_vid
        keys = np.repeat(np.arange(int(grid[0])), n_vid // int(grid[0])) * spg * self.per_second
        order = interleave_audio_video(keys, np.arange(n_audio))
        body = "".join(self.video_token if v else self.audio_token for v in order)
        return self.audio_bos + body + self.audio_eos

    def rope_positions(self, ids: np.ndarray, sample: dict[str, Any], audio_blocks: list[int],
                       spg: list[float]) -> np.ndarray:  # fmt: skip
        """``[4, L]`` float32: the text row and :func:`omni3_positions`."""
        rope = omni3_positions(
            ids, tokens=self.token_ids, image_grid_thw=sample.get("image_grid_thw"),
            video_grid_thw=sample.get("video_grid_thw"), audio_tokens=audio_blocks,
            second_per_grid=spg, merge=self.merge, per_second=self.per_second,
        )  # fmt: skip
        return np.concatenate([np.arange(len(ids), dtype=_F32)[None], rope])


@register_local_processor("qwen3_omni_moe")
def _local_omni3(out_dir: str, family: str, **options: Any) -> dict:
    from lmms_data.processors._audio import _local_audio

    return _local_audio(out_dir, family, **options)
