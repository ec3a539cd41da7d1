"""Long-video sampling (issue 28): ``decode_video`` seeks to the sampled frames instead of decoding
the whole file, so decode work and memory follow the number of sampled frames, not the length.

Synthetic videos are written with PyAV at 48x16 px and 4 fps (a 10-minute file in well under a
second); each frame carries its own index in three 16-px stripes of base-16 digits, so the test
reads back which frame the decoder returned.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from lmms_data._media import decode_video, sample_indices

av = pytest.importorskip("av")

FPS, GOP = 4, 20


def _write(path, seconds: int, codec: str = "mpeg4") -> str:
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=FPS)
        s.width, s.height, s.pix_fmt = 48, 16, "yuv420p"
        s.codec_context.gop_size = GOP
        for i in range(seconds * FPS):
            a = np.empty((16, 48, 3), np.uint8)
            for k in range(3):  # stripe k: digit k of i in base 16, as 16 * digit + 8
                a[:, 16 * k : 16 * k + 16] = (i // 16**k) % 16 * 16 + 8
            c.mux(s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        c.mux(s.encode())
    return str(path)


def _index(frames: np.ndarray) -> np.ndarray:
    """[T, 16, 48, 3] -> [T] the frame index written into each frame's stripes."""
    digits = np.round((frames[:, 8, [8, 24, 40], :].mean(-1) - 8) / 16).astype(np.int64)
    return digits[:, 0] + 16 * digits[:, 1] + 256 * digits[:, 2]


def _decode_traced(path: str, **kw):
    tracemalloc.start()
    try:
        v = decode_video(path, **kw)
        return v, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("ext", ["mp4", "mkv"])  # Matroska headers carry no frame count
def test_ten_minutes_decode_like_one_minute(tmp_path, ext):
    kw = {"fps": 0.5, "max_frames": 32, "multiple": 2}
    paths = {m: _write(tmp_path / f"v{m}.{ext}", 60 * m) for m in (1, 10)}
    decode_video(paths[1], **kw)  # warm-up: PyAV's lazy imports and caches are not the video's
    runs = {}
    for minutes in (1, 10):
        v, peak = _decode_traced(paths[minutes], **kw)
        total = 60 * minutes * FPS
        want = sample_indices(total, FPS, kw["fps"], kw["max_frames"], kw["multiple"])
        # the sampled indices and timestamps are the formula's, and the frames are those frames
        assert v.fps == FPS and v.indices.tolist() == want.tolist()
        np.testing.assert_allclose(v.times, want / FPS, atol=1e-6)
        assert _index(v.frames).tolist() == want.tolist()
        runs[minutes] = (v, peak, total)
    (v1, peak1, _), (v10, peak10, total10) = runs[1], runs[10]
    assert len(v1.frames) == 30 and len(v10.frames) == 32
    # work: at most one keyframe interval per sampled frame, far from the 2400 frames of the file
    assert v10.decoded <= len(v10.frames) * (GOP + 1) < total10 // 2
    # memory: the sampled frames (32 of 48x16x3 here) and the decoder's few, not the length;
    # holding every frame of the 10-minute file would be 2400 * 2.3 KB = 5.5 MB
    assert peak10 < 1.5 * peak1 + 64 * 1024, (peak1, peak10)


def test_short_and_dense_sampling(tmp_path):
    """Targets closer than a keyframe interval are reached by decoding on (no re-seek per frame);
    a video shorter than one temporal group repeats its frames to fill the group."""
    path = _write(tmp_path / "v.mp4", 15)  # 60 frames
    v = decode_video(path, fps=4.0, max_frames=64, multiple=2)
    assert v.indices.tolist() == list(range(60)) and _index(v.frames).tolist() == list(range(60))
    assert v.decoded == 60
    path1 = tmp_path / "one.mp4"
    with av.open(str(path1), "w") as c:
        s = c.add_stream("mpeg4", rate=FPS)
        s.width, s.height, s.pix_fmt = 48, 16, "yuv420p"
        c.mux(s.encode(av.VideoFrame.from_ndarray(np.zeros((16, 48, 3), np.uint8), "rgb24")))
        c.mux(s.encode())
    v1 = decode_video(str(path1), fps=2.0, max_frames=8, multiple=2)
    assert v1.indices.tolist() == [0, 0] and v1.frames.shape == (2, 16, 48, 3)


def test_a_video_part_overrides_the_processor_knobs(proc25, tmp_path):
    """qwen-vl-utils' per-video keys (``fps``, ``max_frames``, ``min_pixels``, ``max_pixels``) on a
    record's video part override ``video_fps`` / ``video_max_frames`` / ``video_*_pixels``, and
    survive record normalisation."""
    from lmms_data import build_processor
    from lmms_data._records import normalise

    path = _write(tmp_path / "v.mp4", 60)  # 240 frames at 4 fps, 48x16
    p = build_processor("qwen2_5_vl", proc25["path"], video_fps=2.0, video_max_frames=32,
                        video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 4)  # fmt: skip

    def grid(**own):
        rec = {"messages": [
            {"role": "user", "content": [{"type": "video", "video": path, **own},
                                         {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "bars"},
        ]}  # fmt: skip
        return p(normalise(rec))["video_grid_thw"][0].tolist()

    t, h, w = grid()
    assert t == 16  # 32 frames / temporal patch 2
    assert grid(fps=0.1)[0] == 3  # 6 frames at 0.1 fps over 60 s
    assert grid(max_frames=8)[0] == 4
    t2, h2, w2 = grid(min_pixels=28 * 28 * 12, max_pixels=28 * 28 * 16)  # 48x16 px upscaled
    assert (h, w) == (2, 4) and t2 == t and h2 * w2 >= 4 * 12  # for this video only
    assert grid() == [t, h, w]
    with pytest.raises(Exception, match="fps must be a positive number"):
        grid(fps=0)
