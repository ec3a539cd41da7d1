"""``build_local_processor(..., family="llava_onevision")``: a tiny LLaVA-OneVision folder.

The shared tiny tokenizer (Qwen special tokens; ``<|image_pad|>`` / ``<|video_pad|>`` serve as the
image and video tokens), the upstream pillow image processor with 32 px views and anyres grid
pinpoints up to 3x3 views, and ``processor_config.json`` with the processor's settings. With
torchvision installed the folder is written by the upstream ``LlavaOnevisionProcessor`` itself
(so ``AutoProcessor.from_pretrained`` loads it). The sizes match ``lmms_models``' tiny
``llava_onevision`` config (32 px views of 8 px patches: 16 features per view; tested).
"""

from __future__ import annotations

import json
import os
from typing import Any

#: the tiny processor's settings (lmms_models' tiny llava_onevision config matches them)
TINY_LLAVA = {
    "view": 32,
    "num_image_tokens": 16,
    "pinpoints": [[32 * a, 32 * b] for a in range(1, 4) for b in range(1, 4)],
    "vision_aspect_ratio": "anyres_max_4",
}


#: the released checkpoints' settings (384 px SigLIP views of 14 px patches, 1..6 tiles a side)
RELEASED_LLAVA = {
    "view": 384,
    "num_image_tokens": 729,
    "pinpoints": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
    "vision_aspect_ratio": "anyres_max_9",
}


def build_local_llava_processor(
    out_dir: str, *, vocab_size: int = 1024, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write a LLaVA-OneVision processor folder with the tiny tokenizer to ``out_dir``; return the
    token ids. ``settings``: :data:`TINY_LLAVA` (default) or :data:`RELEASED_LLAVA` (views for the
    ``0.5b`` / ``7b`` presets of lmms_models, e.g. for GPU speed runs with random weights)."""
    shape = TINY_LLAVA if settings is None else settings
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from lmms_data._local_processor import (
        SPECIAL_TOKENS,
        _has_torchvision,
        _write_info,
        train_tokenizer,
    )

    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer(vocab_size, SPECIAL_TOKENS)
    view = {"height": shape["view"], "width": shape["view"]}
    stats = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    image_processor = LlavaOnevisionImageProcessorPil(
        size=view, crop_size=view, image_grid_pinpoints=shape["pinpoints"], **stats
    )
    settings = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "num_image_tokens": shape["num_image_tokens"],
        "vision_aspect_ratio": shape["vision_aspect_ratio"],
        "vision_feature_select_strategy": "full",
    }
    if _has_torchvision():
        import transformers

        video = transformers.LlavaOnevisionVideoProcessor(size=view, **stats)
        proc = transformers.LlavaOnevisionProcessor(
            image_processor=image_processor, tokenizer=tok, video_processor=video, **settings
        )
        proc.save_pretrained(out_dir)
    else:
        tok.save_pretrained(out_dir)
        image_processor.save_pretrained(out_dir)
    path = os.path.join(out_dir, "processor_config.json")
    saved: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
    with open(path, "w") as f:  # the settings lmms_data reads, whatever upstream saved
        json.dump({"processor_class": "LlavaOnevisionProcessor", **saved, **settings}, f, indent=2)
    return _write_info(out_dir, "llava_onevision", tok, patch=None)
