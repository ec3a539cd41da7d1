"""LLaVA-OneVision processor: chat record -> sample (ids, labels, anyres tiles, video frames).

Images go through the folder's HF image processor (anyres tiling: a base view plus the tiles of
the best grid pinpoint); a sample with several images keeps each image's base view only, as
upstream does. Each image placeholder is expanded to the exact number of features the model
produces for it (:func:`anyres_image_tokens`: base view, then the tile grid unpadded to the
image's aspect ratio, shrunk past ``anyres_max_N`` tiles' worth, one newline per feature row;
tested equal to the upstream processor and to the model's own layout). Video frames are decoded
with PyAV at ``video_fps`` (at most ``video_max_frames``), resized to one view each and counted
as ``frames * ceil(side / 2)**2 + 1`` (2x2 pooling, one newline per video).

Sample media (concatenated in pack order by lmms_data's collator): ``pixel_values [tiles, C, S,
S]``, ``image_sizes [images, 2]``, ``batch_num_images [1]`` (this sample's image count),
``pixel_values_videos [frames, C, S, S]``, ``video_frames [videos]``, ``mm_token_type_ids [L]``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
from PIL import Image

from lmms_data._local_processor import register_local_processor
from lmms_data._media import decode_video_part, load_image
from lmms_data._registry import register_processor
from lmms_data.processors._chat import (
    fill_slots,
    template_messages,
    tokenize_media,
)

__all__ = ["LlavaOnevisionDataProcessor", "anyres_image_tokens"]


def anyres_image_tokens(
    height: int, width: int, *, tile: int, side: int, pinpoints: list, max_tiles: int
) -> int:
    """Features of one single-image sample's image of ``height x width`` px.

    ``tile``: view size in px; ``side``: features per view side (``tile // patch``);
    ``pinpoints``: the anyres grid resolutions ``[[h, w], ...]``; ``max_tiles``: N of
    ``anyres_max_N``. The base view gives ``side**2``; the pinpoint's tile grid gives a feature
    grid of ``side * tiles`` per side, from which the padding around the resized image is cut
    (symmetrically, along the side the aspect ratio left short); past 1.1x the area of
    ``max_tiles`` views both sides shrink by the square root of the excess; every row ends with a
    newline feature.
    """
    from transformers.image_processing_utils import select_best_resolution

    best_h, best_w = select_best_resolution((height, width), pinpoints)
    rows, cols = side * (best_h // tile), side * (best_w // tile)
    if width * rows > cols * height:  # wider than the grid: the image fills the width
        used = int(round(height * cols / width, 7))
        rows -= 2 * ((rows - used) // 2)
    else:
        used = int(round(width * rows / height, 7))
        cols -= 2 * ((cols - used) // 2)
    shrink = math.sqrt(rows * cols / (max_tiles * side * side))
    if shrink > 1.1:
        rows, cols = int(rows // shrink), int(cols // shrink)
    return side * side + rows * (cols + 1)


def _processor_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "processor_config.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


@register_processor("llava_onevision")
class LlavaOnevisionDataProcessor:
    """Turns normalised chat messages into one LLaVA-OneVision sample (docs/contracts.md).

    ``processor``: a local folder (tokenizer, image processor, ``processor_config.json`` with
    ``image_token``, ``video_token``, ``vision_aspect_ratio``, ``num_image_tokens``) or a loaded
    HF processor. Options of
    the Qwen-VL processors that do not apply (``min_pixels``, ...) are accepted and ignored.
    """

    family = "llava_onevision"
    media_types: tuple[str, ...] = ("image", "video")

    def __init__(
        self, processor: Any, *, video_fps: float = 1.0, video_max_frames: int = 32,
        **_unused: Any,
    ) -> None:  # fmt: skip
        if isinstance(processor, str):
            from transformers import AutoImageProcessor, AutoTokenizer

            try:
                ip = AutoImageProcessor.from_pretrained(processor, backend="pil")
            except (TypeError, ValueError, ImportError):  # older transformers: no backend
                ip = AutoImageProcessor.from_pretrained(processor)
            self.tokenizer, self.image_processor = AutoTokenizer.from_pretrained(processor), ip
            conf = _processor_config(processor)
        else:
            self.tokenizer, self.image_processor = processor.tokenizer, processor.image_processor
            conf = {k: getattr(processor, k, None) for k in ("image_token", "video_token",
                    "vision_aspect_ratio", "num_image_tokens", "vision_feature_select_strategy")}  # fmt: skip
        if conf.get("vision_feature_select_strategy") == "default":
            raise NotImplementedError(
                "llava_onevision: vision_feature_select_strategy 'default' (a CLS feature dropped "
                "per view) is not supported; the released checkpoints use 'full'"
            )
        ip = self.image_processor
        self.tile = int(ip.size["height"] if "height" in ip.size else ip.size["shortest_edge"])
        self.side = math.isqrt(int(conf.get("num_image_tokens") or 729))  # features per view side
        self.pinpoints = [list(p) for p in ip.image_grid_pinpoints]
        self.max_tiles = int(str(conf.get("vision_aspect_ratio") or "anyres_max_9")[11:])
        self.image_token = conf.get("image_token") or "<image>"
        self.video_token = conf.get("video_token") or "<video>"
        tid = self.tokenizer.convert_tokens_to_ids
        self.image_token_id, self.video_token_id = tid(self.image_token), tid(self.video_token)
        if self.image_token_id in (None, self.tokenizer.unk_token_id):
            raise ValueError(f"tokenizer lacks the image token {self.image_token!r}")
        self.mean = np.asarray(ip.image_mean, dtype=np.float32)
        self.std = np.asarray(ip.image_std, dtype=np.float32)
        self.video_fps, self.video_max_frames = video_fps, video_max_frames

    # ---- media -----------------------------------------------------------------------------
    def image_tokens(self, height: int, width: int, *, multi: bool) -> int:
        """Placeholder tokens of one image (base view + newline in a multi-image sample)."""
        if multi:
            return self.side * self.side + 1
        return anyres_image_tokens(height, width, tile=self.tile, side=self.side,
                                   pinpoints=self.pinpoints, max_tiles=self.max_tiles)  # fmt: skip

    def process_images(self, images: list[Image.Image]) -> dict[str, np.ndarray]:
        """Views of every image: ``pixel_values [tiles, C, S, S]`` (padding views dropped)."""
        out = self.image_processor([images], return_tensors="np")
        sizes = np.asarray(out["image_sizes"], dtype=np.int64).reshape(-1, 2)
        views = np.asarray(out["pixel_values"], dtype=np.float32)  # [n, max views, C, S, S]
        if len(images) > 1:
            pixels = views[:, 0]
        else:
            pixels = views[0]
        return {"pixel_values": np.ascontiguousarray(pixels), "image_sizes": sizes}

    def process_frames(self, frames: np.ndarray) -> np.ndarray:
        """frames ``[T, H, W, 3]`` uint8 -> ``[T, C, S, S]`` float32 (bicubic, normalised)."""
        size = (self.tile, self.tile)
        x = np.stack([np.asarray(Image.fromarray(f).resize(size, Image.BICUBIC)) for f in frames])
        x = x.astype(np.float32) / 255.0
        x = (x - self.mean) / self.std  # [T, S, S, C]
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))

    # ---- main ------------------------------------------------------------------------------
    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        images, videos = [], []

        def video(part: dict[str, Any]) -> None:
            opts = dict(fps=self.video_fps, max_frames=self.video_max_frames, multiple=1)
            videos.append(decode_video_part(part, **opts))

        take = {"image": lambda part: images.append(load_image(part["image"])), "video": video}
        template_msgs = template_messages(messages, self.family, take)
        text = self.tokenizer.apply_chat_template(template_msgs, tokenize=False)
        sample: dict[str, Any] = {}
        fills: dict[str, list[str]] = {self.image_token: [], self.video_token: []}
        if images:
            sample.update(self.process_images(images))
            sample["batch_num_images"] = np.asarray([len(images)], dtype=np.int64)
            multi = len(images) > 1
            fills[self.image_token] = [
                self.image_token * self.image_tokens(int(h), int(w), multi=multi)
                for h, w in sample["image_sizes"]
            ]
        if videos:
            frames = [self.process_frames(v.frames) for v in videos]
            sample["pixel_values_videos"] = np.concatenate(frames)
            sample["video_frames"] = np.asarray([len(f) for f in frames], dtype=np.int64)
            pooled = math.ceil(self.side / 2) ** 2
            fills[self.video_token] = [self.video_token * (len(f) * pooled + 1) for f in frames]
        for token, expanded in fills.items():
            text = fill_slots(text, token, expanded)
        ids, labels, types = tokenize_media(
            self.tokenizer, text, {self.image_token_id: 1, self.video_token_id: 2}
        )
        sample.update(
            input_ids=ids, labels=labels, length=len(ids), vision_tokens=int((types != 0).sum()),
            mm_token_type_ids=types.astype(np.int64),
        )  # fmt: skip
        return sample


@register_local_processor("llava_onevision")
def _local_llava(out_dir: str, family: str, *, vocab_size: int = 1024, **_: Any) -> dict:
    from lmms_data.processors._local_llava import build_local_llava_processor

    return build_local_llava_processor(out_dir, vocab_size=vocab_size)
