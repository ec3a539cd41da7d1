"""Media decoding: images with Pillow, video with PyAV (extra ``video``), audio with soundfile."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from lmms_data._errors import BadRecordError


def load_image(src: bytes | str) -> Image.Image:
    """Decode fully (``load``) so a truncated file fails here, not later in a worker."""
    try:
        img = Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        where = "<bytes>" if isinstance(src, bytes) else src
        raise BadRecordError("bad_image", f"cannot decode image {where}: {e}") from None


@dataclass(kw_only=True, slots=True)
class VideoFrames:
    frames: np.ndarray  # [T, H, W, 3] uint8
    indices: np.ndarray  # [T] frame index in the source video (its timestamp x ``fps``)
    fps: float  # source frame rate
    times: np.ndarray | None = None  # [T] seconds from the stream's start (the frames' own pts)
    decoded: int = 0  # frames the decoder produced to get these (seeks skip the rest)
    pixels: tuple[int, int] | None = None  # the part's own (min, max) pixels per frame, if given


def sample_indices(
    total: int, native_fps: float, fps: float, max_frames: int, multiple: int
) -> np.ndarray:
    """Evenly spaced frame indices at ``fps`` (capped at ``max_frames``), count a multiple of
    ``multiple`` (the temporal patch size; at least one group)."""
    duration = total / native_fps
    n = min(max_frames, max(1, math.floor(duration * fps)), total)
    n = max(multiple, (n // multiple) * multiple)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def _frame_count(container: Any, stream: Any, native: float) -> int:
    """Frames in the stream: the header's count, else the packets counted by demuxing only (no
    decoding; Matroska/WebM headers often carry no count), else duration x rate."""
    if stream.frames:
        return int(stream.frames)
    n = sum(1 for p in container.demux(stream) if p.size)  # the flush packet has size 0
    if n:
        return n
    if stream.duration is not None:
        return max(1, round(float(stream.duration * stream.time_base) * native))
    return 0


def _seek_decode(
    container: Any, stream: Any, want: list[int], native: float
) -> tuple[dict[int, tuple[int, float, np.ndarray]], int]:
    """Decode only the frames at the sorted indices ``want``: before a target more than one
    keyframe interval (the longest seen so far, at least one second) past the last decoded frame,
    seek to the keyframe at or before it and decode forward to it; closer targets are reached by
    decoding on. A target
    without a frame of its own (variable rate) takes the nearest one. Holds at most the sampled
    frames and two decoded ones. Returns {target: (index, seconds, rgb)} and the frames decoded.
    """
    tb, start = float(stream.time_base), int(stream.start_time or 0)
    out: dict[int, tuple[int, float, np.ndarray]] = {}
    frames: Any = None  # the decode iterator since the last seek
    prev = cur = None  # (index, seconds, frame): the last two frames pulled from it
    gop, last_key, n_decoded = 0, None, 0
    for t in want:
        pos = cur[0] if cur is not None else -1
        if frames is None or t - pos > max(gop, native):
            container.seek(start + int(t / native / tb), stream=stream, backward=True)
            frames, prev, cur, last_key = container.decode(stream), None, None, None
        while cur is None or cur[0] < t:
            f = next(frames, None)
            if f is None:
                break
            if f.pts is None:
                raise BadRecordError("bad_video", "a video frame has no timestamp")
            n_decoded += 1
            sec = (f.pts - start) * tb
            i = round(sec * native)
            if f.key_frame:  # no keyframe between two seen ones, nor between a seek's and t
                span = i - last_key if last_key is not None else t - i
                gop, last_key = max(gop, span), i
            prev, cur = cur, (i, sec, f)
        if cur is not None and cur[0] >= t:
            pick = prev if prev is not None and t - prev[0] < cur[0] - t else cur
        elif cur is not None and t - cur[0] <= 2:  # the header counted a frame or two too many
            pick = cur
        else:
            got = "no frame" if cur is None else f"the last frame is {cur[0]}"
            raise BadRecordError("bad_video", f"video has no frame {t}: {got}")
        out[t] = (pick[0], pick[1], pick[2].to_ndarray(format="rgb24"))
    return out, n_decoded


def decode_video(
    src: bytes | str, *, fps: float, max_frames: int, multiple: int = 2
) -> VideoFrames:
    """Sample ``fps`` frames per second (at most ``max_frames``, a multiple of ``multiple``) with
    :func:`sample_indices` and decode only those (seek + decode forward; see
    :func:`_seek_decode`): memory and decode time follow the number of sampled frames, not the
    video's length, so hour-long files are fine in loader workers."""
    try:
        import av
    except ImportError:
        raise ImportError("video needs PyAV: pip install 'lmms-data[video]'") from None
    where = "<bytes>" if isinstance(src, bytes) else src
    try:
        with av.open(io.BytesIO(src) if isinstance(src, bytes) else src) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            native = float(stream.average_rate or stream.guessed_rate or 24)
            total = _frame_count(container, stream, native)
            if total <= 0:
                raise BadRecordError("bad_video", f"video {where} has no frames")
            idx = sample_indices(total, native, fps, max_frames, multiple)
            got, n_decoded = _seek_decode(container, stream, sorted(set(idx.tolist())), native)
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
        raise BadRecordError("bad_video", f"cannot decode video {where}: {e}") from None
    picks = [got[i] for i in idx.tolist()]
    return VideoFrames(
        frames=np.stack([p[2] for p in picks]),
        indices=np.asarray([p[0] for p in picks], dtype=np.int64),
        fps=native,
        times=np.asarray([p[1] for p in picks], dtype=np.float64),
        decoded=n_decoded,
    )


#: a video part's own sampling keys (qwen-vl-utils' names), over the processor's defaults
VIDEO_PART_OPTIONS = ("fps", "max_frames", "min_pixels", "max_pixels")


def decode_video_part(
    part: dict[str, Any], *, fps: float, max_frames: int, multiple: int,
    min_pixels: int | None = None, max_pixels: int | None = None,
) -> VideoFrames:  # fmt: skip
    """:func:`decode_video` of a ``{"type": "video", "video": ..., "fps"?, "max_frames"?,
    "min_pixels"?, "max_pixels"?}`` part: the part's own keys override the processor's
    ``video_fps`` / ``video_max_frames`` / ``video_min_pixels`` / ``video_max_pixels``."""
    own = {}
    for k in VIDEO_PART_OPTIONS:
        v = part.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise BadRecordError(
                "malformed_record", f"video part {k} must be a positive number, got {v!r}"
            )
        own[k] = v
    out = decode_video(part["video"], fps=float(own.get("fps", fps)),
                       max_frames=int(own.get("max_frames", max_frames)), multiple=multiple)  # fmt: skip
    if ("min_pixels" in own or "max_pixels" in own) and min_pixels and max_pixels:
        out.pixels = (
            int(own.get("min_pixels", min_pixels)),
            int(own.get("max_pixels", max_pixels)),
        )
    return out


def load_audio(src: bytes | str) -> tuple[np.ndarray, int]:
    try:
        import soundfile as sf
    except ImportError:
        raise ImportError("audio needs soundfile: pip install 'lmms-data[audio]'") from None
    try:
        data, sr = sf.read(io.BytesIO(src) if isinstance(src, bytes) else src, dtype="float32")
    except (RuntimeError, OSError, ValueError) as e:
        raise BadRecordError("bad_audio", f"cannot decode audio: {e}") from None
    return data, sr
