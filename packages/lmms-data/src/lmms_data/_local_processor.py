"""``build_local_processor``: a tiny, deterministic HF-format processor folder for tests and demos.

No hub is needed: a small byte-level BPE tokenizer is trained with ``tokenizers`` on a fixed corpus
(including the synthetic demo data's words), Qwen's special tokens get the first ids, and a
Qwen-style chat template plus the image processor config are written next to it. The folder loads
with ``AutoProcessor.from_pretrained(path)`` (and ``AutoTokenizer`` / ``AutoImageProcessor``).
The image processor uses the pillow backend (``*ImageProcessorPil``) when torchvision is missing;
then the folder holds the tokenizer and image processor only (transformers 5.x cannot build a
Qwen-VL ``AutoProcessor`` without torchvision), which is all ``lmms_data`` needs. For a text
family (``qwen2``, ``qwen2_5``, ``qwen3``) the folder holds the tokenizer only (same special
tokens and chat template), loadable with ``AutoTokenizer.from_pretrained(path)``.

This module holds the shared parts (tokenizer, chat template, the registry); what a family's
folder holds is registered by its module of :mod:`lmms_data.processors`
(:func:`register_local_processor`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any

#: ``family -> builder(out_dir, family, *, vocab_size, min_pixels, max_pixels) -> info``: the local
#: processor folder of each processor family, filled by the family's module of
#: :mod:`lmms_data.processors` (:func:`register_local_processor`).
LOCAL_PROCESSOR_BUILDERS: dict[str, Callable[..., dict[str, Any]]] = {}


def register_local_processor(*names: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` builds the local processor folder of the processor families ``names``
    (a name already taken is refused)."""

    def deco(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        for name in names:
            if name in LOCAL_PROCESSOR_BUILDERS:
                raise ValueError(f"a local processor builder for {name!r} is already registered")
            LOCAL_PROCESSOR_BUILDERS[name] = fn
        return fn

    return deco


SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_pad|>",
)


def chat_template(media: str, prelude: str = "") -> str:
    """A Qwen chat template (a default system turn, string or list contents, the generation
    prompt) whose list contents render a part by ``media`` (Jinja ``{% if %}``/``{% elif %}``
    branches on ``content['type']``), text parts as their text; ``prelude`` opens the template."""
    head = (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
    )
    tail = (
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return prelude + head + media + tail


#: images and videos between the vision markers, as the released Qwen-VL templates render them
VISION_PARTS = (
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
)
CHAT_TEMPLATE = chat_template(VISION_PARTS)

_CORPUS = [
    "You are a helpful assistant.",
    "Describe the image. What colour is the shape? How many shapes are there?",
    "There is a red circle, a green square, a blue triangle and a yellow star on a white background.",
    "The picture shows two red circles and one blue square. There are three shapes.",
    "Answer: one two three four five six seven eight nine ten zero.",
    "What is in the video? The shape moves from left to right.",
    "user assistant system the a an is are of and in on to with what how many which colour color",
    "red green blue yellow purple orange white black circle square triangle star shape shapes",
    "0 1 2 3 4 5 6 7 8 9 10 . , ? ! : ; ' \" ( ) - \n",
]


def _has_torchvision() -> bool:
    try:
        return importlib.util.find_spec("torchvision") is not None
    except (ValueError, ImportError):  # blocked (sys.modules entry set to None)
        return False


def build_local_processor(
    out_dir: str,
    family: str | None = None,
    *,
    vocab_size: int = 1024,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 256,
) -> dict[str, Any]:
    """Write a tokenizer + chat template + image processor folder to ``out_dir`` (< 1 s), as the
    processor family ``family`` registered it (:data:`LOCAL_PROCESSOR_BUILDERS`; text families
    get a tokenizer-only folder; None: ``lmms_data.processors.DEFAULT_PROCESSOR_FAMILY``).

    Returns ``{"path", "vocab_size", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "eos_token_id", "pad_token_id", ...}`` so a tiny model config can match.
    """
    from lmms_data.processors import DEFAULT_PROCESSOR_FAMILY  # the families register builders

    family = family or DEFAULT_PROCESSOR_FAMILY
    builder = LOCAL_PROCESSOR_BUILDERS.get(family)
    if builder is None:
        raise ValueError(f"unknown family {family!r}; known: {sorted(LOCAL_PROCESSOR_BUILDERS)}")
    return builder(
        out_dir, family, vocab_size=vocab_size, min_pixels=min_pixels, max_pixels=max_pixels
    )


def build_text_processor(out_dir: str, family: str, *, vocab_size: int = 1024) -> dict[str, Any]:
    """A tokenizer-only folder (the Qwen special tokens and chat template)."""
    os.makedirs(out_dir, exist_ok=True)
    hf_tok = train_tokenizer(vocab_size, SPECIAL_TOKENS)
    hf_tok.save_pretrained(out_dir)
    return _write_info(out_dir, family, hf_tok, patch=None)


def train_tokenizer(
    vocab_size: int, special_tokens: tuple[str, ...], chat_template: str = CHAT_TEMPLATE
) -> Any:
    """The tiny byte-level BPE tokenizer on the fixed corpus; ``special_tokens`` get the first
    ids (``<|endoftext|>`` first: the pad token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(special_tokens[1:]),
    )
    hf_tok.chat_template = chat_template
    return hf_tok


def _write_info(out_dir: str, family: str, hf_tok: Any, patch: int | None) -> dict[str, Any]:
    ids = {t: hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    info = {
        "path": out_dir,
        "family": family,
        "vocab_size": len(hf_tok),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_token_id": ids["<|audio_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "patch_size": patch,
        "special_token_ids": ids,
    }
    with open(os.path.join(out_dir, "lmms_processor_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info
