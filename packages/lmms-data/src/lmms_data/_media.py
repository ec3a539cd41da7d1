"""Media decoding: images with Pillow, video with PyAV (extra ``video``), audio with soundfile."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

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
    indices: np.ndarray  # [T] frame index in the source video
    fps: float  # source frame rate


def sample_indices(
    total: int, native_fps: float, fps: float, max_frames: int, multiple: int
) -> np.ndarray:
    """Evenly spaced frame indices at ``fps`` (capped at ``max_frames``), count a multiple of
    ``multiple`` (the temporal patch size; at least one group)."""
    duration = total / native_fps
    n = min(max_frames, max(1, math.floor(duration * fps)), total)
    n = max(multiple, (n // multiple) * multiple)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def decode_video(
    src: bytes | str, *, fps: float, max_frames: int, multiple: int = 2
) -> VideoFrames:
    try:
        import av
    except ImportError:
        raise ImportError("video needs PyAV: pip install 'lmms-data[video]'") from None
    try:
        with av.open(io.BytesIO(src) if isinstance(src, bytes) else src) as container:
            stream = container.streams.video[0]
            native = float(stream.average_rate or stream.guessed_rate or 24)
            total = int(stream.frames or 0)
            # known length: keep only the sampled frames while decoding (bounded memory)
            want = (
                set(sample_indices(total, native, fps, max_frames, multiple).tolist())
                if total
                else None
            )
            decoded = {}
            for i, f in enumerate(container.decode(stream)):
                if want is None or i in want:
                    decoded[i] = f.to_ndarray(format="rgb24")
            n = i + 1 if decoded else 0
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
        where = "<bytes>" if isinstance(src, bytes) else src
        raise BadRecordError("bad_video", f"cannot decode video {where}: {e}") from None
    if not decoded:
        raise BadRecordError("bad_video", "video has no frames")
    idx = sample_indices(n, native, fps, max_frames, multiple)
    if any(i not in decoded for i in idx.tolist()):  # header frame count was wrong
        raise BadRecordError("bad_video", f"video header says {total} frames, decoded {n}")
    return VideoFrames(frames=np.stack([decoded[i] for i in idx.tolist()]), indices=idx, fps=native)


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
