"""The audio path: decoding (soundfile, PyAV, video sound tracks), resampling, long-audio policy,
features and token counts equal to transformers' Qwen2AudioProcessor, bad audio skipped/raised and
counted, packed batches and the synthetic tone-digit data."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")
av = pytest.importorskip("av")
import soundfile as sf  # noqa: E402

import lmms_data as ld  # noqa: E402
from lmms_data import AudioOptions, BadRecordError, decode_audio, load_audio_clips  # noqa: E402
from lmms_data._loader import discover  # noqa: E402


def _tone(hz: float, seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return x if channels == 1 else np.stack([x, 0.5 * x], 1)


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[spec.argmax()])


def _encode_av(
    x: np.ndarray, rate: int, fmt: str, codec: str, *, video: bool = False, frames: int = 5
) -> bytes:
    """Compressed audio (or a video with a sound track) written by PyAV (FFmpeg)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        if video:
            vs = c.add_stream("mpeg4", rate=10)
            vs.width = vs.height = 32
            vs.pix_fmt = "yuv420p"
        st = c.add_stream(codec, rate=rate)
        st.layout = "mono"
        frame_len = st.codec_context.frame_size or 1024
        for i in range(0, len(x), frame_len):
            chunk = x[i : i + frame_len]
            if len(chunk) < frame_len:
                chunk = np.pad(chunk, (0, frame_len - len(chunk)))
            fr = av.AudioFrame.from_ndarray(
                chunk[None].astype(np.float32), format="fltp", layout="mono"
            )
            fr.sample_rate, fr.pts = rate, i
            for p in st.encode(fr):
                c.mux(p)
        for p in st.encode(None):
            c.mux(p)
        if video:
            for i in range(frames):
                img = np.full((32, 32, 3), (40 * i) % 250, np.uint8)
                for p in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in vs.encode(None):
                c.mux(p)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_soundfile_formats_mono_and_resampled(fmt):
    buf = io.BytesIO()
    sf.write(buf, _tone(440, 1.0, 22050, channels=2), 22050, format=fmt)
    x = decode_audio(buf.getvalue(), 16000)
    assert x.dtype == np.float32 and x.ndim == 1
    assert abs(len(x) - 16000) <= 2  # 1 s at the target rate
    assert abs(_peak_hz(x, 16000) - 440) < 3  # the pitch survives the rate change
    assert 0.25 < np.abs(x).max() < 0.35  # stereo (0.4, 0.2) averaged to mono 0.3


def test_compressed_audio_and_video_sound_through_pyav(tmp_path):
    x = _tone(660, 1.0, 16000)
    m4a = _encode_av(x, 16000, "mp4", "aac")
    y = decode_audio(m4a, 16000)  # libsndfile cannot read AAC: PyAV does
    assert abs(len(y) - 16000) < 2048 and abs(_peak_hz(y, 16000) - 660) < 5
    mp4 = tmp_path / "clip.mp4"
    mp4.write_bytes(_encode_av(x, 16000, "mp4", "aac", video=True))
    z = decode_audio(str(mp4), 8000, from_video=True)  # a video's own sound track
    assert abs(len(z) - 8000) < 1024 and abs(_peak_hz(z, 8000) - 660) < 5
    silent = tmp_path / "silent.mp4"
    silent.write_bytes((tmp_path / "clip.mp4").read_bytes()[:40])
    with pytest.raises(BadRecordError, match="bad_audio"):
        decode_audio(str(silent), 16000, from_video=True)


def test_long_audio_chunk_truncate_skip():
    buf = io.BytesIO()
    sf.write(buf, _tone(300, 7.0, 16000), 16000, format="WAV")
    src = buf.getvalue()
    clips = load_audio_clips(src, 16000, AudioOptions(max_seconds=3.0))
    assert [len(c) for c in clips] == [48000, 48000, 16000]
    assert [len(c) for c in load_audio_clips(src, 16000, AudioOptions(max_seconds=3.0, long_audio="truncate"))] == [48000]  # fmt: skip
    with pytest.raises(BadRecordError, match=r"lasts 7\.0 s > audio_max_seconds 3"):
        load_audio_clips(src, 16000, AudioOptions(max_seconds=3.0, long_audio="skip"))
    with pytest.raises(BadRecordError, match="max_total_seconds"):
        load_audio_clips(src, 16000, AudioOptions(max_total_seconds=5.0))
    with pytest.raises(ValueError, match="long_audio"):
        AudioOptions(long_audio="drop")


@pytest.fixture(scope="module")
def proc_audio(tmp_path_factory) -> dict:
    return ld.build_local_processor(str(tmp_path_factory.mktemp("proca")), "qwen2_audio")


def _msgs(*audio, answer="Two tones."):
    user = [{"type": "audio", "audio": a} for a in audio] + [{"type": "text", "text": "What?"}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def test_processor_equals_upstream_qwen2_audio_processor(proc_audio, tmp_path):
    """Token ids (placeholder expansion) and log-mel features equal transformers' own processor
    on the same decoded audio; samples keep the valid frames plus 2 of the window's padding."""
    from transformers import AutoProcessor

    clips = [_tone(440, 1.37, 16000), _tone(880, 2.0, 44100, channels=2)]
    paths = []
    for i, (c, rate) in enumerate(zip(clips, (16000, 44100), strict=True)):
        paths.append(str(tmp_path / f"a{i}.wav"))
        sf.write(paths[-1], c, rate)
    p = ld.build_processor("qwen2_audio", proc_audio["path"])
    s = p(_msgs(*paths))
    up = AutoProcessor.from_pretrained(proc_audio["path"])
    audio = [decode_audio(x, 16000) for x in paths]
    text = up.apply_chat_template(_msgs("a", "b"), tokenize=False)
    ref = up(text=text, audio=audio, sampling_rate=16000, return_tensors="np")
    np.testing.assert_array_equal(s["input_ids"], ref["input_ids"][0])
    lens = ref["feature_attention_mask"].sum(-1)
    np.testing.assert_array_equal(s["audio_feature_lens"], lens)
    np.testing.assert_array_equal(s["audio_frames"], lens + 2)
    want = np.concatenate(
        [f[:, : n + 2].T for f, n in zip(ref["input_features"], lens, strict=True)]
    )
    np.testing.assert_array_equal(s["input_features"], want)
    n_tok = int((s["input_ids"] == proc_audio["audio_token_id"]).sum())
    assert n_tok == s["audio_tokens"] == int(ld.processors.audio_output_lengths(lens).sum())
    assert (s["mm_token_type_ids"] == ld.AUDIO_TYPE_ID).sum() == n_tok
    assert (s["labels"][s["mm_token_type_ids"] != 0] == -100).all()


def test_processor_chunks_long_audio_into_one_placeholder_run(proc_audio, tmp_path):
    path = tmp_path / "long.wav"
    sf.write(path, _tone(500, 65.0, 16000), 16000)
    s = ld.build_processor("qwen2_audio", proc_audio["path"])(_msgs(str(path)))
    assert s["audio_feature_lens"].tolist() == [3000, 3000, 500]  # 30 s + 30 s + 5 s
    assert s["audio_frames"].tolist() == [3000, 3000, 502]
    ids = s["input_ids"]
    where = np.flatnonzero(ids == proc_audio["audio_token_id"])
    assert len(where) == 750 + 750 + 125 and (np.diff(where) == 1).all()  # one run
    with pytest.raises(ValueError, match="at most the encoder's window"):
        ld.build_processor("qwen2_audio", proc_audio["path"], audio_max_seconds=60)


def test_bad_audio_corpus_skipped_counted_or_raised(proc_audio, tmp_path):
    good = io.BytesIO()
    sf.write(good, _tone(440, 0.5, 16000), 16000, format="WAV")
    (tmp_path / "ok.wav").write_bytes(good.getvalue())
    (tmp_path / "corrupt.wav").write_bytes(good.getvalue()[:30])  # truncated header
    (tmp_path / "text.ogg").write_bytes(b"this is not audio at all" * 10)
    empty = io.BytesIO()
    sf.write(empty, np.zeros(0, np.float32), 16000, format="WAV")
    (tmp_path / "empty.wav").write_bytes(empty.getvalue())
    nan = io.BytesIO()
    sf.write(nan, np.full(800, np.nan, np.float32), 16000, format="WAV", subtype="FLOAT")
    (tmp_path / "nan.wav").write_bytes(nan.getvalue())
    over = io.BytesIO()
    sf.write(over, _tone(440, 4.0, 16000), 16000, format="WAV")
    (tmp_path / "long.wav").write_bytes(over.getvalue())
    bad = ["corrupt.wav", "text.ogg", "empty.wav", "nan.wav", "long.wav"]
    lines = [json.dumps({"messages": _msgs("ok.wav")})]
    for b in bad:
        lines += [json.dumps({"messages": _msgs(b)}), lines[0]]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")

    def stream(**kw):
        cfg = ld.DatasetConfig(dataset_path=str(tmp_path / "d.jsonl"), packing_length=512,
                               shuffle=False, num_epochs=1, processor_family="qwen2_audio",
                               extra={"audio_max_seconds": 3.0, "audio_long": "skip"}, **kw)  # fmt: skip
        p = ld.build_processor("qwen2_audio", proc_audio["path"], cfg)
        return ld.SlotStream(cfg, discover(cfg, 1), p, slot=0, n_slots=1)

    s = stream(max_bad_record_ratio=0.9)
    batches = list(s)
    assert sum(b["num_samples"] for b in batches) == len(bad) + 1
    assert s.stats.bad == {"bad_audio": len(bad)}
    for name, line in zip(bad, range(2, 2 * len(bad) + 1, 2), strict=True):
        assert any(f"d.jsonl line {line}:" in e for e in s.stats.examples), name
    b = batches[0]
    n = b["audio_feature_lens"].numel()
    assert b["input_features"].shape == (int(b["audio_frames"].sum()), 128) and n >= 1
    assert b["audio_tokens"] == int((b["mm_token_type_ids"] == ld.AUDIO_TYPE_ID).sum()) > 0
    with pytest.raises(BadRecordError, match=r"\[bad_audio\].*d.jsonl line 2"):
        list(stream(bad_record_policy="raise"))


def test_synthetic_audio_records_decode(tmp_path, proc_audio):
    paths = ld.generate_synthetic_audio(str(tmp_path / "pq"), 12, "parquet", seed=3)
    cfg = ld.DatasetConfig(dataset_path=paths[0], packing_length=1024, shuffle=False,
                           num_epochs=1, bad_record_policy="raise")  # fmt: skip
    p = ld.build_processor("qwen2_audio", proc_audio["path"], cfg)
    s = ld.SlotStream(cfg, discover(cfg, 1), p, slot=0, n_slots=1)
    assert sum(b["num_samples"] for b in s) == 12
    js = ld.generate_synthetic_audio(str(tmp_path / "js"), 3, "jsonl", seed=3)
    with open(js[0]) as f:
        rec = json.loads(f.readline())
    assert rec["messages"][0]["content"][0]["audio"].endswith(".wav")
