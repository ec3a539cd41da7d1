"""Plain-text pretraining: a ``text`` dataset type and the ``text_pretrain`` processor.

A corpus record is ``{"text": "<document>"}`` (JSONL, Parquet or Arrow column ``text``); the
``text`` dataset type turns it into one assistant message so it flows through the same stream,
packing and bad-record policy as chat data. ``text_pretrain`` tokenizes the text of every part
*without* a chat template (no role tokens), appends the tokenizer's EOS (the document boundary a
pretrained model learns to emit) and supervises every token. Documents longer than
``packing_length`` are split into consecutive chunks of ``packing_length`` tokens, each packed as
a document of its own with positions restarting at 0 (``splits_long_samples``; the choice and
why: :mod:`lmms_data._stream`); give the processor ``max_tokens`` (dataset_config extra key) to
keep only their first tokens instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmms_data._errors import BadRecordError
from lmms_data._local_processor import build_text_processor, register_local_processor
from lmms_data._registry import register_dataset, register_processor
from lmms_data.processors._chat import load_tokenizer

# media options build_processor passes to every processor; meaningless for text
_MEDIA_OPTIONS = frozenset(
    ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "video_fps",
     "video_max_frames", "tokens_per_second")
)  # fmt: skip


@register_dataset("text")
def text_record(record: dict[str, Any]) -> dict[str, Any]:
    """``{"text": str}`` -> one assistant message holding the document."""
    text = record.get("text")
    if not isinstance(text, str):
        raise BadRecordError("malformed_record", "a text record needs a string 'text' field")
    return {"messages": [{"role": "assistant", "content": [{"type": "text", "text": text}]}]}


@register_processor("text_pretrain")
class PretrainTextProcessor:
    """Messages -> ``{input_ids [L], labels [L] (= input_ids), position_ids [L], length}``."""

    media_types: tuple[str, ...] = ()
    #: a document longer than packing_length is split into chunks by the stream, not dropped
    splits_long_samples: bool = True

    def __init__(self, processor: Any, *, max_tokens: int | None = None, **options: Any) -> None:
        unknown = sorted(set(options) - _MEDIA_OPTIONS)
        if unknown:
            raise TypeError(f"PretrainTextProcessor got unknown option(s) {unknown}")
        self.tokenizer = load_tokenizer(processor)
        if self.tokenizer.eos_token_id is None:
            raise ValueError("text_pretrain needs a tokenizer with an EOS token")
        self.max_tokens = max_tokens

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        texts = []
        for m in messages:
            for part in m["content"]:
                if part["type"] != "text":
                    raise BadRecordError(
                        "unsupported_media", f"text pretraining cannot take {part['type']} parts"
                    )
                texts.append(part["text"])
        text = "\n".join(texts)
        if not text.strip():
            raise BadRecordError("empty_conversation", "a text record without text")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_tokens is not None:
            ids = ids[: self.max_tokens - 1]
        ids = np.asarray([*ids, self.tokenizer.eos_token_id], dtype=np.int64)
        n = len(ids)
        return {
            "input_ids": ids,  # [L]
            "labels": ids.copy(),  # [L]: every token is a target
            "position_ids": np.arange(n, dtype=np.int64),  # [L]
            "length": n,
        }


@register_local_processor("text_pretrain")
def _local_pretrain(out_dir: str, family: str, *, vocab_size: int = 1024, **_: Any) -> dict:
    """Plain-text pretraining reads the text families' tokenizer folder."""
    return build_text_processor(out_dir, "qwen3", vocab_size=vocab_size)
