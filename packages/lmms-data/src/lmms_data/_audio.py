"""Audio decoding for the audio processors: files and video sound tracks -> mono float32 at the
feature extractor's rate, split or cut to a maximum duration.

* WAV / FLAC / OGG (and whatever else libsndfile reads) go through ``soundfile``; anything it
  cannot open (MP3 on old libsndfile, AAC/M4A, Opus in WebM, a video's sound track) through
  PyAV (FFmpeg). Both are the ``audio`` extra: ``pip install 'lmms-data[audio]'``.
* Channels are averaged to mono; the rate is converted with ``soxr`` (the SoX resampler,
  band-limited, "HQ" quality), so every audio reaches the extractor at its own rate.
* Every failure is a :class:`~lmms_data.BadRecordError` of reason ``bad_audio`` (corrupt,
  unreadable, empty, non-finite samples, longer than allowed with ``long_audio="skip"``), so bad
  audio follows the same skip/raise policy and counters as bad images.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from lmms_data._errors import BadRecordError

__all__ = ["LONG_AUDIO_POLICIES", "AudioOptions", "decode_audio", "load_audio_clips", "resample"]

#: what to do with audio longer than ``max_seconds``
LONG_AUDIO_POLICIES = ("chunk", "truncate", "skip")


@dataclass(kw_only=True, slots=True)
class AudioOptions:
    """Audio options of a processor (``dataset_config.extra``: ``audio_max_seconds``, ...).

    * ``max_seconds``: longest clip handed to the feature extractor (``None``: no limit).
    * ``long_audio``: longer audio is cut into consecutive clips of ``max_seconds`` ("chunk",
      the last one shorter; each clip is one encoder input, their tokens follow each other in
      the same placeholder run), cut at ``max_seconds`` ("truncate") or a bad record ("skip").
    * ``max_total_seconds``: a record whose audio is longer than this in all is a bad record
      (``None``: no limit); guards memory against hour-long files.
    * ``min_samples``: shorter audio (after resampling) is a bad record (an empty file decodes
      to nothing; the encoders need at least a few feature frames).
    """

    max_seconds: float | None = 30.0
    long_audio: str = "chunk"
    max_total_seconds: float | None = 20 * 60.0
    min_samples: int = 400

    def __post_init__(self) -> None:
        if self.long_audio not in LONG_AUDIO_POLICIES:
            raise ValueError(
                f"long_audio must be one of {LONG_AUDIO_POLICIES}, got {self.long_audio!r}"
            )
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"audio max_seconds must be positive, got {self.max_seconds}")


def _where(src: bytes | str) -> str:
    return "<bytes>" if isinstance(src, bytes) else str(src)


def _read_soundfile(src: bytes | str) -> tuple[np.ndarray, int] | None:
    """``(samples [n, channels] float32, rate)``, or None when libsndfile cannot open it."""
    try:
        import soundfile as sf
    except ImportError:
        raise ImportError("audio needs soundfile: pip install 'lmms-data[audio]'") from None
    try:
        data, sr = sf.read(
            io.BytesIO(src) if isinstance(src, bytes) else src, dtype="float32", always_2d=True
        )
    except (sf.LibsndfileError, RuntimeError, OSError, ValueError, TypeError):
        return None
    return data, int(sr)


def _read_av(src: bytes | str, *, video: bool) -> tuple[np.ndarray, int]:
    """``(samples [n, channels] float32, rate)`` of the first audio stream, decoded by PyAV."""
    try:
        import av
    except ImportError:
        raise ImportError(
            "compressed audio and video sound need PyAV: pip install 'lmms-data[audio]'"
        ) from None
    what = "video" if video else "audio"
    try:
        with av.open(io.BytesIO(src) if isinstance(src, bytes) else src) as container:
            if not container.streams.audio:
                raise BadRecordError("bad_audio", f"{what} {_where(src)} has no audio stream")
            stream = container.streams.audio[0]
            # planar or packed, any sample format -> packed float32 [n, channels]
            resampler = av.AudioResampler(format="flt", layout=stream.layout.name)
            chunks, rate = [], int(stream.rate or stream.codec_context.sample_rate or 0)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1, len(out.layout.channels)))
            for out in resampler.resample(None):  # flush
                chunks.append(out.to_ndarray().reshape(-1, len(out.layout.channels)))
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
        raise BadRecordError("bad_audio", f"cannot decode {what} {_where(src)}: {e}") from None
    if not chunks or rate <= 0:
        raise BadRecordError("bad_audio", f"{what} {_where(src)} has no audio samples")
    return np.concatenate(chunks).astype(np.float32, copy=False), rate


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono ``x [n]`` from ``rate`` to ``target`` Hz with soxr ("HQ"); unchanged if equal."""
    if rate == target:
        return x
    try:
        import soxr
    except ImportError:
        raise ImportError("audio resampling needs soxr: pip install 'lmms-data[audio]'") from None
    return soxr.resample(x, rate, target, quality="HQ").astype(np.float32, copy=False)


def decode_audio(src: bytes | str, sampling_rate: int, *, from_video: bool = False) -> np.ndarray:
    """Mono float32 samples ``[n]`` at ``sampling_rate`` from an audio file (or bytes), or from
    a video's sound track (``from_video``: PyAV only). Raises ``BadRecordError("bad_audio")``."""
    got = None if from_video else _read_soundfile(src)
    data, rate = got if got is not None else _read_av(src, video=from_video)
    if data.size == 0:
        raise BadRecordError("bad_audio", f"audio {_where(src)} is empty")
    mono = data.mean(axis=1) if data.ndim == 2 else data  # [n]
    if not np.isfinite(mono).all():
        raise BadRecordError("bad_audio", f"audio {_where(src)} has non-finite samples")
    return resample(np.ascontiguousarray(mono, dtype=np.float32), rate, sampling_rate)


def load_audio_clips(
    src: bytes | str, sampling_rate: int, options: AudioOptions, *, from_video: bool = False
) -> list[np.ndarray]:
    """Decode ``src`` and apply ``options``: the clips ``[n_i]`` one audio part becomes."""
    x = decode_audio(src, sampling_rate, from_video=from_video)
    seconds = x.shape[0] / sampling_rate
    if x.shape[0] < options.min_samples:
        raise BadRecordError(
            "bad_audio", f"audio {_where(src)} has {x.shape[0]} samples (< {options.min_samples})"
        )
    if options.max_total_seconds is not None and seconds > options.max_total_seconds:
        raise BadRecordError(
            "bad_audio",
            f"audio {_where(src)} lasts {seconds:.1f} s > max_total_seconds "
            f"{options.max_total_seconds}",
        )
    if options.max_seconds is None or seconds <= options.max_seconds:
        return [x]
    step = int(options.max_seconds * sampling_rate)
    if options.long_audio == "skip":
        raise BadRecordError(
            "bad_audio",
            f"audio {_where(src)} lasts {seconds:.1f} s > audio_max_seconds {options.max_seconds}",
        )
    if options.long_audio == "truncate":
        return [x[:step]]
    n = math.ceil(x.shape[0] / step)
    clips = [x[i * step : (i + 1) * step] for i in range(n)]
    if clips[-1].shape[0] < options.min_samples:  # a sliver too short to encode: dropped
        clips.pop()
    return clips
