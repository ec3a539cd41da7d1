"""Synthetic "spoken digits" a tiny audio model can learn: each digit is a tone of its own pitch.

A record is a clip of 1-4 digits (200 ms tones, 80 ms gaps, a little noise, a random level and
sample rate: 8, 16, 22.05 or 44.1 kHz, so resampling is exercised) with a question
("What digits do you hear?", "How many digits are there?", "What is the first digit?") and the
templated answer. Pitch tells the digit, so the answer is learnable only through the audio tower.
"""

from __future__ import annotations

import io
import os

import numpy as np

from lmms_data._synthetic import write_shards

__all__ = [
    "DIGIT_HZ",
    "audio_records",
    "generate_synthetic_audio",
    "generate_synthetic_omni",
    "tone_digits",
]

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: pitch of each digit (Hz): a semitone scale from 300 Hz, far apart in the mel bins
DIGIT_HZ = tuple(300.0 * 2 ** (2 * i / 12) for i in range(10))
_RATES = (8000, 16000, 22050, 44100)


def tone_digits(
    digits: list[int], rate: int, *, rng: np.random.Generator, tone_s: float = 0.2,
    gap_s: float = 0.08,
) -> np.ndarray:  # fmt: skip
    """Mono float32 ``[n]``: one tone per digit (Hann-shaped), gaps between, light noise."""
    tone = int(tone_s * rate)
    gap = np.zeros(int(gap_s * rate), np.float32)
    t = np.arange(tone) / rate
    env = np.hanning(tone).astype(np.float32)
    parts = [gap]
    for d in digits:
        parts += [(np.sin(2 * np.pi * DIGIT_HZ[d] * t) * env).astype(np.float32), gap]
    x = np.concatenate(parts) * float(rng.uniform(0.2, 0.8))
    return (x + rng.normal(0, 0.01, x.shape)).astype(np.float32)


def audio_records(n: int, *, seed: int = 0):
    """Yield ``(question, answer, wav_bytes)`` triples, deterministic in ``seed``."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    for _ in range(n):
        digits = [int(d) for d in rng.integers(0, 10, size=int(rng.integers(1, 5)))]
        rate = _RATES[int(rng.integers(len(_RATES)))]
        buf = io.BytesIO()
        sf.write(buf, tone_digits(digits, rate, rng=rng), rate, format="WAV", subtype="PCM_16")
        kind = int(rng.integers(3))
        if kind == 0:
            q, a = "What digits do you hear?", " ".join(DIGITS[d] for d in digits) + "."
        elif kind == 1:
            q, a = "How many digits are there?", f"There are {DIGITS[len(digits)]}."
        else:
            q, a = "What is the first digit?", f"{DIGITS[digits[0]].capitalize()}."
        yield q, a, buf.getvalue()


def generate_synthetic_audio(
    out_dir: str, n: int, format: str = "parquet", seed: int = 0, *, num_shards: int = 1,
    rows_per_group: int = 64,
) -> list[str]:  # fmt: skip
    """Write ``n`` audio chat records to ``out_dir`` and return the shard paths.

    ``parquet``: columns ``messages`` (JSON string) and ``audios`` (list of WAV bytes).
    ``jsonl``: WAV files under ``out_dir/audio`` referenced by relative path.
    """
    try:
        import soundfile  # noqa: F401
    except ImportError:
        raise ImportError(
            "synthetic audio needs soundfile: pip install 'lmms-data[audio]'"
        ) from None
    if format not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {format!r}")
    os.makedirs(out_dir, exist_ok=True)
    recs = list(audio_records(n, seed=seed))
    return write_shards(out_dir, recs, "audio", format, num_shards, rows_per_group)


def generate_synthetic_omni(
    out_dir: str, n: int, format: str = "parquet", seed: int = 0, *, image_size: int = 64
) -> list[str]:
    """Half coloured-shape image records, half tone-digit audio records, as two shards of
    ``out_dir`` (``images-00000.*``, ``audio-00000.*``): demo data for omni models."""
    import shutil
    import tempfile

    from lmms_data._synthetic import generate_synthetic_vl

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        made = {
            "images": generate_synthetic_vl(
                os.path.join(tmp, "images"), n - n // 2, format, seed, image_size=image_size
            ),
            "audio": generate_synthetic_audio(os.path.join(tmp, "audio"), n // 2, format, seed),
        }
        for kind, files in made.items():
            src_dir = os.path.dirname(files[0])
            for sub in ("images", "audio"):  # jsonl media folders, referenced relatively
                if os.path.isdir(os.path.join(src_dir, sub)):
                    shutil.copytree(os.path.join(src_dir, sub), os.path.join(out_dir, sub),
                                    dirs_exist_ok=True)  # fmt: skip
            for f in files:
                dst = os.path.join(out_dir, f"{kind}-" + os.path.basename(f).split("-", 1)[1])
                shutil.move(f, dst)
                paths.append(dst)
    return paths
