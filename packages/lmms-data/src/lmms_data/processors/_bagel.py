"""BAGEL processor: an interleaved chat record -> the part list ``lmms_models``' bagel packer takes.

Messages use the usual format (docs/data.md): ``{"role", "content": [{"type": "text" | "image"}]}``.

* Text of every turn is rendered as ``<|im_start|>{role}\\n{text}<|im_end|>\\n`` (Qwen2.5's chat
  markup, which BAGEL keeps); assistant text is supervised (``loss``), the rest is context.
* An image in a *user / system* turn is understood: a ``vit`` part (pixels in [-1, 1], SigLIP's
  0.5 mean/std, resized to multiples of the ViT patch with the longer side at most
  ``max_vit_side``). In an editing record (the assistant also answers with an image) the same
  image is given a second time as clean VAE latents (``vae_cond``), as BAGEL does.
* An image in an *assistant* turn is generated: a ``vae_gen`` part (pixels in [-1, 1], sides
  multiples of ``latent_downsample`` = VAE factor x latent patch, longer side at most
  ``max_gen_side``), noised and trained by flow matching. The model side turns its pixels into
  latents (the frozen VAE, or the tiny pixel-space stand-in: see docs/bagel.md).

Output: ``{"parts": [...], "length": tokens of the sample, "start_of_image", "end_of_image",
"vision_tokens"}``. The loader adds the sample's ``seed`` (its record reference hashed) and packs
samples by ``length`` like any other; :func:`collate_parts` makes the pack a *row of parts*, which
the model side (``BagelSpec.finish_pack``: lmms_models' ``pack_samples``) turns into the packed
row it trains on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from lmms_data._errors import BadRecordError
from lmms_data._local_processor import register_local_processor
from lmms_data._media import load_image
from lmms_data._registry import register_processor
from lmms_data.processors._chat import load_tokenizer

__all__ = ["BagelDataProcessor", "collate_parts", "fit_side"]


def fit_side(h: int, w: int, multiple: int, max_side: int) -> tuple[int, int]:
    """``(h, w)`` scaled so the longer side is at most ``max_side``, each rounded down to a
    multiple of ``multiple`` (at least one multiple)."""
    scale = min(1.0, max_side / max(h, w))
    return (max(multiple, int(h * scale) // multiple * multiple),
            max(multiple, int(w * scale) // multiple * multiple))  # fmt: skip


def _pixels(img: Image.Image, h: int, w: int) -> np.ndarray:
    """RGB ``[3, h, w]`` float32 in [-1, 1]."""
    img = img.convert("RGB")
    if img.size != (w, h):
        img = img.resize((w, h), Image.BICUBIC)
    return (np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0).copy()


@register_processor("bagel")
class BagelDataProcessor:
    """Chat messages with images to understand and images to generate -> BAGEL parts."""

    media_types: tuple[str, ...] = ("image",)

    def __init__(
        self, processor: Any, *, vit_patch_size: int = 14, max_vit_side: int = 980,
        latent_downsample: int = 16, max_gen_side: int = 1024, **_: Any,
    ) -> None:  # fmt: skip
        self.tokenizer = load_tokenizer(processor)
        self.vit_patch, self.max_vit = vit_patch_size, max_vit_side
        self.lat_down, self.max_gen = latent_downsample, max_gen_side
        tid = self.tokenizer.convert_tokens_to_ids
        self.start_of_image, self.end_of_image = tid("<|vision_start|>"), tid("<|vision_end|>")
        unk = self.tokenizer.unk_token_id
        if self.start_of_image in (None, unk) or self.end_of_image in (None, unk):
            raise ValueError("tokenizer lacks <|vision_start|>/<|vision_end|>: not a Qwen2.5 one")

    def _text(self, text: str, loss: bool) -> dict[str, Any]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"type": "text", "ids": list(ids), "loss": loss}

    def generation_prompt(self, text: str) -> list[dict[str, Any]]:
        """The parts of a user turn ``text`` followed by the assistant's header: what a sampler
        packs before the image slot it fills (``lmms-train render``)."""
        return [self._text("<|im_start|>user\n", False), self._text(text, False),
                self._text("<|im_end|>\n", False), self._text("<|im_start|>assistant\n", False)]  # fmt: skip

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        editing = any(
            p["type"] == "image" for m in messages if m["role"] == "assistant" for p in m["content"]
        )
        parts: list[dict[str, Any]] = []
        length = vision = 0
        for m in messages:
            gen = m["role"] == "assistant"
            parts.append(self._text(f"<|im_start|>{m['role']}\n", False))
            for part in m["content"]:
                t = part["type"]
                if t == "text":
                    parts.append(self._text(part["text"], gen))
                elif t == "image":
                    src = part["image"]
                    img = src.convert("RGB") if isinstance(src, Image.Image) else load_image(src)
                    if gen:
                        h, w = fit_side(img.height, img.width, self.lat_down, self.max_gen)
                        parts.append({"type": "vae_gen", "pixels": _pixels(img, h, w)})
                        length += (h // self.lat_down) * (w // self.lat_down) + 2
                        continue
                    h, w = fit_side(img.height, img.width, self.vit_patch, self.max_vit)
                    parts.append({"type": "vit", "pixels": _pixels(img, h, w)})
                    length += (h // self.vit_patch) * (w // self.vit_patch) + 2
                    vision += (h // self.vit_patch) * (w // self.vit_patch)
                    if editing:
                        h, w = fit_side(img.height, img.width, self.lat_down, self.max_gen)
                        parts.append({"type": "vae_cond", "pixels": _pixels(img, h, w)})
                        length += (h // self.lat_down) * (w // self.lat_down) + 2
                else:
                    raise BadRecordError("unsupported_media", f"bagel cannot take {t} parts")
            parts.append(self._text("<|im_end|>\n", gen))
        length += sum(len(p["ids"]) for p in parts if p["type"] == "text")
        if (
            not any(p.get("loss") for p in parts)
            and not editing
            and not any(p["type"] == "vae_gen" for p in parts)
        ):
            raise BadRecordError("no_assistant", "nothing to learn: no assistant text or image")
        return {"parts": parts, "length": length, "start_of_image": self.start_of_image,
                "end_of_image": self.end_of_image, "vision_tokens": vision}  # fmt: skip


def collate_parts(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One pack of BAGEL samples -> a row of parts (host data; nothing is tokenised or encoded
    here): ``{"bagel_parts": [parts per sample], "seeds": [int], "lengths": [int],
    "start_of_image", "end_of_image", "num_samples", "vision_tokens"}``. ``seeds`` default to the
    pack position when the samples carry none (a processor called outside the loader)."""
    return {
        "bagel_parts": [s["parts"] for s in samples],
        "seeds": [int(s.get("seed", i)) for i, s in enumerate(samples)],
        "lengths": [int(s["length"]) for s in samples],
        "start_of_image": int(samples[0]["start_of_image"]),
        "end_of_image": int(samples[0]["end_of_image"]),
        "num_samples": len(samples),
        "vision_tokens": int(sum(int(s.get("vision_tokens", 0)) for s in samples)),
    }


@register_local_processor("bagel")
def _local_bagel(out_dir: str, family: str, **options: Any) -> dict[str, Any]:
    """BAGEL reads Qwen2.5's tokenizer (``<|vision_start|>`` / ``<|vision_end|>``): the
    Qwen2.5-VL folder."""
    from lmms_data.processors._qwen_vl import LOCAL_VL, build_vl_processor

    return build_vl_processor(out_dir, "qwen2_5_vl", LOCAL_VL["qwen2_5_vl"], **options)
