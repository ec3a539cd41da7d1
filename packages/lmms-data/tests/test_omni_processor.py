"""Qwen2.5-Omni processor: TMRoPE positions equal the upstream thinker's get_rope_index on the
processor's own ids (images, video with its sound track interleaved, standalone audio, chunked),
token counts follow upstream's formulas, and features come from the folder's extractor."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")
pytest.importorskip("av")
import soundfile as sf
import torch
from PIL import Image
from test_audio import _encode_av, _tone

import lmms_data as ld


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    d = tmp_path_factory.mktemp("omni")
    info = ld.build_local_processor(str(d / "proc"), "qwen2_5_omni")
    buf = io.BytesIO()
    Image.fromarray(np.full((60, 90, 3), 120, np.uint8)).save(buf, format="PNG")
    (d / "img.png").write_bytes(buf.getvalue())
    sf.write(d / "a.wav", _tone(440, 2.3, 22050), 22050)
    (d / "v.mp4").write_bytes(
        _encode_av(_tone(330, 5.2, 16000), 16000, "mp4", "aac", video=True, frames=50)
    )
    return d, info


def _upstream_positions(info, sample, use_audio_in_video):
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    cfg = Qwen2_5OmniThinkerConfig(
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, output_dim=32),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=14),
        text_config=dict(vocab_size=info["vocab_size"], hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        image_token_index=info["image_token_id"], video_token_index=info["video_token_id"],
        audio_token_index=info["audio_token_id"], audio_start_token_id=info["audio_bos_token_id"],
        audio_end_token_id=info["audio_eos_token_id"], vision_start_token_id=info["vision_start_token_id"],
        vision_end_token_id=info["vision_end_token_id"],
    )  # fmt: skip
    model = Qwen2_5OmniThinkerForConditionalGeneration(cfg)
    return _rope_index(model, sample, use_audio_in_video)[:, 0].numpy()


def _rope_index(model, sample, use_audio_in_video) -> torch.Tensor:
    """Upstream's ``get_rope_index`` of a thinker ``model`` on one processed ``sample``:
    positions ``[3, 1, L]``."""
    ids = torch.as_tensor(sample["input_ids"])[None]
    g = lambda k: torch.as_tensor(sample[k]) if k in sample else None  # noqa: E731
    rope_index = (
        getattr(model.model, "get_rope_index", None) or model.get_rope_index
    )  # 5.17: thinker
    pos, _ = rope_index(
        ids, g("image_grid_thw"), g("video_grid_thw"), torch.ones_like(ids), use_audio_in_video,
        g("audio_feature_lens"), g("second_per_grid_ts"),
    )  # fmt: skip
    return pos


@pytest.mark.parametrize("use_audio_in_video", [True, False])
def test_positions_and_tokens_equal_upstream(omni, use_audio_in_video):
    d, info = omni
    msgs = [
        {"role": "user", "content": [
            {"type": "image", "image": str(d / "img.png")},
            {"type": "video", "video": str(d / "v.mp4")},
            {"type": "text", "text": "and"},
            {"type": "audio", "audio": str(d / "a.wav")},
            {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A tone."}]},
    ]  # fmt: skip
    p = ld.build_processor("qwen2_5_omni", info["path"], use_audio_in_video=use_audio_in_video,
                           video_fps=4.0)  # fmt: skip
    s = p(msgs)
    np.testing.assert_array_equal(
        s["position_ids"][1:], _upstream_positions(info, s, use_audio_in_video)
    )
    ids, types = s["input_ids"], s["mm_token_type_ids"]
    lens = s["audio_feature_lens"].tolist()
    assert len(lens) == (2 if use_audio_in_video else 1)
    assert int((ids == info["audio_token_id"]).sum()) == int(
        ld.processors.audio_output_lengths(np.array(lens)).sum()
    )
    assert (types == ld.AUDIO_TYPE_ID).sum() == s["audio_tokens"]
    assert s["input_features"].shape == (sum(lens), 128)  # valid frames only
    merge2 = 4
    assert (ids == info["image_token_id"]).sum() == s["image_grid_thw"].prod(-1).sum() // merge2
    assert (ids == info["video_token_id"]).sum() == s["video_grid_thw"].prod(-1).sum() // merge2
    if use_audio_in_video:  # 5 s of video: video and audio tokens alternate in 2 s chunks
        run = np.flatnonzero(np.diff(types[types >= 2]) != 0)
        assert len(run) >= 4
    assert (s["labels"][types != 0] == -100).all()


def _omni3_upstream_interleave(s, info, pps):
    """The video-with-sound placeholder string of upstream's Qwen3-Omni processor (its own
    ``replace_video_with_audio_token``, the same rule as 5.17's inline loop) for ``s``'s first
    video and the audio block sitting in it."""
    from types import SimpleNamespace

    from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as proc

    ns = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), audio_bos_token="B",
                         audio_eos_token="E", video_token="V", audio_token="A")  # fmt: skip
    ids = s["input_ids"]
    bos = int(np.flatnonzero(ids == info["audio_bos_token_id"])[0])
    eos = int(np.flatnonzero(ids == info["audio_eos_token_id"])[0])
    n_audio = int((ids[bos:eos] == info["audio_token_id"]).sum())
    video = {"video_grid_thw": s["video_grid_thw"],
             "video_second_per_grid": [float(x) for x in s["second_per_grid_ts"]]}  # fmt: skip
    if hasattr(proc.Qwen3OmniMoeProcessor, "replace_video_with_audio_token"):
        text = proc.Qwen3OmniMoeProcessor.replace_video_with_audio_token(
            ns, video, 0, {"num_audio_tokens": [n_audio]}, 0, position_id_per_seconds=pps
        )
    else:  # pragma: no cover - transformers without the method (5.17): none to compare to
        pytest.skip("this transformers has no replace_video_with_audio_token")
    mine = "".join({info["audio_token_id"]: "A", info["video_token_id"]: "V",
                    info["audio_bos_token_id"]: "B", info["audio_eos_token_id"]: "E"}[int(t)]
                   for t in ids[bos : eos + 1])  # fmt: skip
    return mine, text


@pytest.mark.parametrize(("use_audio_in_video", "pps"), [(False, 4), (True, 13), (True, 25)])
def test_qwen3_omni_moe_positions_and_tokens_equal_upstream(
    omni, tmp_path, use_audio_in_video, pps
):
    """Qwen3-Omni-MoE: Qwen3-Omni's clip-to-token rule (upstream's own length function), the
    video-with-sound interleaving of upstream's processor, and TMRoPE positions equal to the
    upstream thinker's get_rope_index, fractional ones included (video at 4 fps with ``tp = 2``:
    0.5 s per temporal patch, 6.5 positions at 13 per second, 12.5 at 25; float32 equal)."""
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as upstream

    d, _ = omni
    info = ld.build_local_processor(str(tmp_path / "proc3"), "qwen3_omni_moe")
    msgs = [
        {"role": "user", "content": [
            {"type": "image", "image": str(d / "img.png")},
            {"type": "video", "video": str(d / "v.mp4")},
            {"type": "audio", "audio": str(d / "a.wav")},
            {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A tone."}]},
    ]  # fmt: skip
    p = ld.build_processor("qwen3_omni_moe", info["path"], video_fps=4.0,
                           position_id_per_seconds=pps, use_audio_in_video=use_audio_in_video)  # fmt: skip
    s = p(msgs)
    lens = torch.as_tensor(s["audio_feature_lens"])
    assert len(lens) == (2 if use_audio_in_video else 1)
    n_aud = int((s["input_ids"] == info["audio_token_id"]).sum())
    assert n_aud == int(upstream._get_feat_extract_output_lengths(lens, 50).sum())
    assert n_aud != int(ld.processors.audio_output_lengths(lens.numpy()).sum())  # not Qwen2.5's
    cfg = Qwen3OmniMoeThinkerConfig(
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16,
                          output_dim=32, downsample_hidden_size=8),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           patch_size=16, deepstack_visual_indexes=[0]),
        text_config=dict(vocab_size=info["vocab_size"], hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=2,
                         num_experts_per_tok=1, moe_intermediate_size=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        image_token_id=info["image_token_id"], video_token_id=info["video_token_id"],
        audio_token_id=info["audio_token_id"], audio_start_token_id=info["audio_bos_token_id"],
        audio_end_token_id=info["audio_eos_token_id"], vision_start_token_id=info["vision_start_token_id"],
        vision_end_token_id=info["vision_end_token_id"], position_id_per_seconds=pps,
    )  # fmt: skip
    model = Qwen3OmniMoeThinkerForConditionalGeneration(cfg)
    pos = _rope_index(model, s, use_audio_in_video)
    ids = torch.as_tensor(s["input_ids"])[None]
    assert s["position_ids"].dtype == np.float32 and pos.dtype == torch.float32
    np.testing.assert_array_equal(s["position_ids"][1:], pos[:, 0].numpy())  # bit for bit
    np.testing.assert_array_equal(s["position_ids"][0], np.arange(len(ids[0])))
    frac = s["position_ids"][1:] % 1
    assert (frac != 0).any() == (pps != 4)  # the fractional times are really there
    text_only = p([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "A tone."}]}])  # fmt: skip
    row = ld.collate_packed_batch([text_only, s])  # the packed batch keeps them, float32
    assert row["position_ids"].dtype == torch.float32
    np.testing.assert_array_equal(row["position_ids"][:, -len(ids[0]) :].numpy(), s["position_ids"])
    if use_audio_in_video:
        mine, theirs = _omni3_upstream_interleave(s, info, pps)
        assert mine == theirs
        assert "VA" in mine and "AV" in mine  # interleaved token by token, not in 2 s runs
