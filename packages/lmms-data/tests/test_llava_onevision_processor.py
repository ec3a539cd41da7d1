"""LLaVA-OneVision processor: placeholder counts equal the upstream processor's (single image
over many sizes and aspect ratios, multi-image, video), views equal its pillow image processor,
labels only on assistant turns, and packs carry the per-sample image counts."""

from __future__ import annotations

import io

import numpy as np
import pytest
from lmms_data_testutil import random_png, random_video
from PIL import Image

import lmms_data as ld
from lmms_data import build_processor, collate_packed_batch

SIZES = [(53, 35), (35, 53), (32, 32), (200, 20), (20, 200), (96, 64), (95, 97), (150, 150)]


def _chat(*parts):
    user = [{"type": k, k: v} for k, v in parts] + [{"type": "text", "text": "What is it?"}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": "A red circle."}]},
    ]


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    return ld.build_local_processor(str(tmp_path_factory.mktemp("llava")), "llava_onevision")


def _upstream(info):
    pytest.importorskip("torchvision")  # upstream's processor needs its video processor
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(info["path"])


def test_image_tokens_equal_the_upstream_processor(info):
    hf = _upstream(info)
    p = build_processor("llava_onevision", info["path"])
    prompt = hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], tokenize=False
    )
    for h, w in SIZES:
        img = Image.open(io.BytesIO(random_png(h, w)))
        want = int(
            (
                hf(text=[prompt], images=[[img]], return_tensors="np")["input_ids"]
                == hf.image_token_id
            ).sum()
        )
        assert p.image_tokens(h, w, multi=False) == want, (h, w)
        s = p(_chat(("image", random_png(h, w))))
        assert int((s["mm_token_type_ids"] == 1).sum()) == want, (h, w)
    two = hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], tokenize=False
    )
    imgs = [Image.open(io.BytesIO(random_png(*s))) for s in SIZES[:2]]
    want = int(
        (hf(text=[two], images=[imgs], return_tensors="np")["input_ids"] == hf.image_token_id).sum()
    )
    s = p(_chat(("image", random_png(*SIZES[0])), ("image", random_png(*SIZES[1]))))
    assert int((s["mm_token_type_ids"] == 1).sum()) == want == 2 * 17  # base view + newline each
    assert s["pixel_values"].shape == (2, 3, 32, 32) and s["batch_num_images"].tolist() == [2]


def test_views_equal_the_pillow_image_processor(info):
    from transformers import AutoImageProcessor

    ip = AutoImageProcessor.from_pretrained(info["path"], backend="pil")
    p = build_processor("llava_onevision", info["path"])
    s = p(_chat(("image", random_png(53, 35))))
    ref = ip([[Image.open(io.BytesIO(random_png(53, 35)))]], return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(s["pixel_values"], ref)
    assert s["image_sizes"].tolist() == [[53, 35]]
    text = s["labels"][s["labels"] != -100]
    assert len(text) and (s["mm_token_type_ids"][s["labels"] != -100] == 0).all()


def test_video_tokens_and_packs(info, tmp_path):
    p = build_processor("llava_onevision", info["path"], video_fps=4.0, video_max_frames=4)
    s = p(_chat(("video", random_video(tmp_path / "v.mp4", n=5, h=40, w=60))))
    frames = int(s["video_frames"][0])
    assert s["pixel_values_videos"].shape == (frames, 3, 32, 32) and 1 <= frames <= 4
    assert int((s["mm_token_type_ids"] == 2).sum()) == frames * 4 + 1  # 2x2 pooled + newline
    try:
        hf = _upstream(info)
    except pytest.skip.Exception:
        hf = None
    if hf is not None:
        prompt = hf.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}]}], tokenize=False
        )
        clip = np.zeros((frames, 40, 60, 3), dtype=np.uint8)
        out = hf(text=[prompt], videos=[clip], do_sample_frames=False, return_tensors="np")
        assert int((out["input_ids"] == hf.video_token_id).sum()) == frames * 4 + 1
    one = p(_chat(("image", random_png(53, 35))))
    two = p(_chat(("image", random_png(20, 30)), ("image", random_png(30, 20))))
    batch = collate_packed_batch([one, s, two])
    assert batch["batch_num_images"].tolist() == [1, 2]
    assert batch["image_sizes"].shape == (3, 2) and batch["video_frames"].tolist() == [frames]
    assert batch["pixel_values"].shape[0] == one["pixel_values"].shape[0] + 2
