"""Qwen-VL processors: labels, exact token counts (vs the HF processor), mRoPE vs upstream."""

from __future__ import annotations

import inspect
import io
import json
import os

import numpy as np
import pytest
import torch
from lmms_data_testutil import random_png, random_video
from PIL import Image

import lmms_data as ld
from lmms_data import build_processor, normalise


def _messages(img1, img2, video=None):
    user2 = [{"type": "text", "text": "And this?"}, {"type": "image", "image": img2}]
    if video:
        user2.append({"type": "video", "video": video})
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": img1}, {"type": "text", "text": "What colour?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A red circle."}]},
        {"role": "user", "content": user2},
        {"role": "assistant", "content": [{"type": "text", "text": "Two blue squares."}]},
    ]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_labels_tokens_and_hf_parity(family, proc25, proc3):
    info = proc25 if family == "qwen2_5_vl" else proc3
    p = build_processor(family, info["path"], max_pixels=28 * 28 * 64)
    a, b = random_png(70, 100, 1), random_png(130, 60, 2)
    s = p(_messages(a, b))
    tok = p.tokenizer
    sup = s["labels"] != -100
    assert tok.decode(s["input_ids"][sup]) == "A red circle.<|im_end|>Two blue squares.<|im_end|>"
    assert (s["labels"][sup] == s["input_ids"][sup]).all()
    n_img = (s["input_ids"] == info["image_token_id"]).sum()
    assert n_img == s["vision_tokens"] == (s["image_grid_thw"].prod(-1) // 4).sum()
    assert s["length"] == len(s["input_ids"]) and s["position_ids"].shape == (4, s["length"])
    assert (s["position_ids"][0] == np.arange(s["length"])).all()
    assert s["pixel_values"].shape[0] == s["image_grid_thw"].prod(-1).sum()
    # the upstream HF processor, given the same template text, yields the same ids and grids
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(info["path"])
    tmpl = [{"role": m["role"], "content": [{"type": c["type"], "text": c.get("text", "")} for c in m["content"]]}
            for m in _messages(a, b)]  # fmt: skip
    text = tok.apply_chat_template(tmpl, tokenize=False)
    imgs = [Image.open(io.BytesIO(x)).convert("RGB") for x in (a, b)]
    out = hf(text=[text], images=imgs, return_tensors="np",
             images_kwargs={"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}})  # fmt: skip
    assert (out["input_ids"][0] == s["input_ids"]).all()
    assert (out["image_grid_thw"] == s["image_grid_thw"]).all()
    # pillow vs torchvision resize of noise images differ slightly; same layout and normalisation
    assert out["pixel_values"].shape == s["pixel_values"].shape
    assert np.abs(out["pixel_values"] - s["pixel_values"]).mean() < 0.02
    if family == "qwen3_vl":
        assert (out["mm_token_type_ids"][0] == s["mm_token_type_ids"]).all()
    types = np.where(s["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>"), 1, 0)
    assert (s["mm_token_type_ids"] == types).all()  # every family: placeholders known on the host


def _tiny_model(family, info):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen3VLConfig, Qwen3VLModel

    text = dict(vocab_size=info["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})  # fmt: skip
    ids = dict(image_token_id=info["image_token_id"], video_token_id=info["video_token_id"],
               vision_start_token_id=info["vision_start_token_id"])  # fmt: skip
    if family == "qwen2_5_vl":
        vis = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2)  # fmt: skip
        return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=text, vision_config=vis, **ids))
    vis = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
               deepstack_visual_indexes=[])  # fmt: skip
    text["rope_parameters"]["mrope_section"] = [2, 3, 3]
    return Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vis, **ids))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_matches_upstream_get_rope_index(family, proc25, proc3, tmp_path):
    info = proc25 if family == "qwen2_5_vl" else proc3
    p = build_processor(family, info["path"], max_pixels=28 * 28 * 64, video_max_pixels=32 * 32 * 8,
                        video_min_pixels=32 * 32, video_fps=2.0)  # fmt: skip
    s = p(
        _messages(
            random_png(70, 100),
            random_png(130, 60),
            random_video(tmp_path / "v.mp4", n=12, h=56, w=84),
        )
    )
    assert s["video_grid_thw"].shape == (1, 3) and s["video_grid_thw"][0, 0] >= 2
    model = _tiny_model(family, info)
    ids = torch.from_numpy(s["input_ids"])[None]
    kw = dict(image_grid_thw=torch.from_numpy(s["image_grid_thw"]),
              video_grid_thw=torch.from_numpy(s["video_grid_thw"]))  # fmt: skip
    params = inspect.signature(model.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        types = np.zeros_like(s["input_ids"])
        types[s["input_ids"] == info["image_token_id"]] = 1
        types[s["input_ids"] == info["video_token_id"]] = 2
        kw["mm_token_type_ids"] = torch.from_numpy(types)[None]
    if family == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.from_numpy(s["second_per_grid_ts"])
    with torch.no_grad():
        ref, _ = model.get_rope_index(ids, **kw)
    np.testing.assert_array_equal(ref[:, 0].numpy(), s["position_ids"][1:])
    # the model accepts the sample: placeholder counts equal its vision features per image/video
    fwd = dict(input_ids=ids, pixel_values=torch.from_numpy(s["pixel_values"]),
               pixel_values_videos=torch.from_numpy(s["pixel_values_videos"]),
               position_ids=torch.from_numpy(s["position_ids"])[:, None], **kw)  # fmt: skip
    fwd.pop("second_per_grid_ts", None)
    with torch.no_grad():
        h = model(**fwd).last_hidden_state
    assert h.shape[:2] == (1, s["length"])
    if family == "qwen3_vl":  # per-frame timestamps in the prompt, as upstream
        text = p.tokenizer.decode(s["input_ids"])
        assert (
            "seconds>" in text
            and text.count("<|vision_start|>") == 2 + 1 + s["video_grid_thw"][0, 0]
        )
        assert (s["mm_token_type_ids"] == 2).sum() == s["video_grid_thw"].prod() // 4


def test_video_patches_match_hf_video_processor(proc25, tmp_path):
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    p = build_processor(
        "qwen2_5_vl", proc25["path"], video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 64
    )
    frames = np.random.default_rng(0).integers(
        0, 255, (4, 56, 84, 3), dtype=np.uint8
    )  # already on the grid
    mine, grid = p.patchify_video(frames)
    vp = AutoProcessor.from_pretrained(proc25["path"]).video_processor
    out = vp(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], return_tensors="np", do_sample_frames=False,
             size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 64})  # fmt: skip
    assert (out["video_grid_thw"][0] == grid).all()
    np.testing.assert_allclose(out["pixel_values_videos"], mine, atol=1e-4)


def test_local_processor_folder(proc25, tmp_path):
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(proc25["path"])
    for t, i in proc25["special_token_ids"].items():
        assert hf.tokenizer.convert_tokens_to_ids(t) == i
    assert proc25["vocab_size"] <= 1024
    again = ld.build_local_processor(str(tmp_path / "again"))
    for f in ("tokenizer.json", "chat_template.jinja"):
        with open(os.path.join(proc25["path"], f)) as a, open(os.path.join(again["path"], f)) as b:
            assert a.read() == b.read(), f"{f} is not deterministic"


def test_llava_conversion():
    rec = {"image": ["a.jpg", "b.jpg"], "conversations": [
        {"from": "human", "value": "<image>\nCompare with <image> please."}, {"from": "gpt", "value": "Same."}]}  # fmt: skip
    m = normalise(rec)
    assert m[0]["content"] == [
        {"type": "image", "image": "a.jpg"}, {"type": "text", "text": "Compare with "},
        {"type": "image", "image": "b.jpg"}, {"type": "text", "text": " please."},
    ]  # fmt: skip
    assert m[1] == {"role": "assistant", "content": [{"type": "text", "text": "Same."}]}
    with pytest.raises(ld.BadRecordError, match="media_mismatch"):
        normalise({"image": "a.jpg", "conversations": rec["conversations"]})
    cols = {"messages": json.dumps([{"role": "user", "content": [{"type": "image"}]},
                                    {"role": "assistant", "content": "x"}]), "images": [b"1"]}  # fmt: skip
    assert normalise(cols)[0]["content"][0] == {"type": "image", "image": b"1"}


def test_image_patches_equal_hf_pillow_image_processor(proc25):
    p = build_processor("qwen2_5_vl", proc25["path"], max_pixels=28 * 28 * 64)
    for h, w in [(70, 100), (336, 336), (20, 500), (1000, 30)]:  # up, down, extreme aspect
        img = Image.fromarray(np.random.default_rng(h).integers(0, 255, (h, w, 3), dtype=np.uint8))
        mine = p.process_images([img])
        ref = p.image_processor(images=[img], return_tensors="np",
                                size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels})  # fmt: skip
        assert (mine["image_grid_thw"] == ref["image_grid_thw"]).all()
        np.testing.assert_allclose(mine["pixel_values"], ref["pixel_values"], atol=1e-5)


def test_works_without_torchvision(tmp_path):
    """Users and the GPU image may lack torchvision: folder, processor and loader still work."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["torchvision"] = None  # as if not installed
import lmms_data as ld
ld.build_local_processor({str(tmp_path / "p")!r})
q = ld.build_processor("qwen2_5_vl", {str(tmp_path / "p")!r})
assert type(q.image_processor).__name__.endswith("Pil"), type(q.image_processor)
ld.generate_synthetic_vl({str(tmp_path / "d")!r}, 12)
cfg = ld.DatasetConfig(dataset_path={str(tmp_path / "d")!r}, packing_length=256, num_epochs=1)
print("samples", sum(b["num_samples"] for b in ld.build_dataloader(cfg, {str(tmp_path / "p")!r}, num_workers=0)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "samples 12" in out.stdout
