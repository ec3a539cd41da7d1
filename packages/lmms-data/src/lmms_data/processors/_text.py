"""Text-only chat processor of the Qwen text families (qwen2, qwen2_5, qwen3, qwen3_moe).

One class, registered under every text family name the model specs use. The tokenizer's own chat
template renders the conversation (text parts of a turn are joined into a string, the form every
Qwen text template expects); labels cover assistant turns only (``_chat.tokenize_chat``, the same
rule as the Qwen-VL processors); ``position_ids`` is ``arange(L)``. Image/video/audio parts are
bad records of reason ``unsupported_media`` (``media_types`` is empty, so the stream rejects them
before resolving or decoding any media).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmms_data._errors import BadRecordError
from lmms_data._local_processor import build_text_processor, register_local_processor
from lmms_data._registry import register_processor
from lmms_data.processors._chat import IGNORE_INDEX, load_tokenizer, tokenize_chat

#: processor families of the text-only model specs (qwen3_moe uses "qwen3")
TEXT_FAMILIES = ("qwen2", "qwen2_5", "qwen3")

# media options build_processor passes to every processor; meaningless without media
_MEDIA_OPTIONS = frozenset(
    ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "video_fps",
     "video_max_frames", "tokens_per_second")
)  # fmt: skip


def _register_all(cls: type) -> type:
    for name in TEXT_FAMILIES:
        register_processor(name)(cls)
    return cls


@_register_all
class QwenTextProcessor:
    """Chat messages -> ``{input_ids [L], labels [L], position_ids [L], length}``."""

    media_types: tuple[str, ...] = ()  # parts this processor accepts besides text

    def __init__(self, processor: Any, **options: Any) -> None:
        unknown = sorted(set(options) - _MEDIA_OPTIONS)
        if unknown:
            raise TypeError(f"QwenTextProcessor got unknown option(s) {unknown}")
        self.tokenizer = load_tokenizer(processor)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        turns = []
        for m in messages:
            texts = []
            for part in m["content"]:
                if part["type"] != "text":
                    raise BadRecordError(
                        "unsupported_media", f"a text-only model cannot take {part['type']} parts"
                    )
                texts.append(part["text"])
            turns.append({"role": m["role"], "content": "".join(texts)})
        text = self.tokenizer.apply_chat_template(turns, tokenize=False)
        ids, labels = tokenize_chat(self.tokenizer, text)
        if not (labels != IGNORE_INDEX).any():
            raise BadRecordError("no_assistant", "no supervised token after templating")
        L = len(ids)
        return {
            "input_ids": ids,  # [L]
            "labels": labels,  # [L]
            "position_ids": np.arange(L, dtype=np.int64),  # [L]
            "length": L,
        }


@register_local_processor(*TEXT_FAMILIES)
def _local_text(out_dir: str, family: str, *, vocab_size: int = 1024, **_: Any) -> dict[str, Any]:
    return build_text_processor(out_dir, family, vocab_size=vocab_size)
