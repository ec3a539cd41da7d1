"""Shared by the processors: load a tokenizer, render messages for the chat template, fill its
media placeholders, tokenise a rendered chat, label assistant turns.

Labels are the tokens of assistant turns (their text and the closing ``<|im_end|>``), found by
character offsets in the templated text, so the rule holds for any tokenizer of the Qwen chat
format (``<|im_start|>role\\n ... <|im_end|>``) and of the LLaMA-3 chat format that LLaDA's
tokenizer uses (``<|start_header_id|>assistant<|end_header_id|>\\n\\n ... <|eot_id|>``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lmms_data._errors import BadRecordError

IGNORE_INDEX = -100
ASSISTANT_SPAN = re.compile(r"<\|im_start\|>assistant\n(.*?)(<\|im_end\|>)", re.S)
#: The LLaMA-3 chat format (LLaDA-8B-Instruct's tokenizer): the answer and its ``<|eot_id|>``.
LLAMA3_ASSISTANT_SPAN = re.compile(
    r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?)(<\|eot_id\|>)", re.S
)


def load_tokenizer(processor: Any) -> Any:
    """A tokenizer from a local folder path, an HF processor (its ``.tokenizer``) or a tokenizer."""
    if isinstance(processor, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(processor)
    return getattr(processor, "tokenizer", None) or processor


def tokenize_chat(tokenizer: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Templated ``text`` -> (input_ids [L], labels [L]); labels are ``IGNORE_INDEX`` outside
    assistant turns."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)  # [L]
    starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)  # [L]
    labels = np.full_like(ids, IGNORE_INDEX)
    spans = ASSISTANT_SPAN if "<|im_start|>" in text else LLAMA3_ASSISTANT_SPAN
    for mt in spans.finditer(text):
        sel = (starts >= mt.start(1)) & (starts < mt.end(2))
        labels[sel] = ids[sel]
    return ids, labels


def template_messages(
    messages: list[dict[str, Any]],
    who: str,
    take: Mapping[str, Callable[[dict[str, Any]], object]],
    *,
    name_media: bool = False,
) -> list[dict[str, Any]]:
    """The messages the chat template renders: text parts as given; each media part is handed to
    ``take[its type]`` in message order and becomes ``{"type": t}`` (``{"type": t, t: t}`` with
    ``name_media``: templates that test either key). A type without a taker is refused, naming
    ``who``."""
    template = []
    for m in messages:
        parts = []
        for part in m["content"]:
            t = part["type"]
            if t == "text":
                parts.append({"type": t, "text": part["text"]})
                continue
            if t not in take:
                raise BadRecordError("unsupported_media", f"{who} cannot take {t} parts")
            take[t](part)
            parts.append({"type": t, t: t} if name_media else {"type": t})
        template.append({"role": m["role"], "content": parts})
    return template


def check_slots(text: str, counts: Mapping[str, int]) -> None:
    """Refuse a templated ``text`` whose placeholder ``token`` count is not ``counts[token]``."""
    for token, n in counts.items():
        if text.count(token) != n:
            raise BadRecordError(
                "media_mismatch", f"template has {text.count(token)} {token} slots for {n} media"
            )


def fill_slots(text: str, token: str, fills: Sequence[str]) -> str:
    """``text`` with its ``token`` placeholders replaced by ``fills``, in order."""
    check_slots(text, {token: len(fills)})
    pieces = text.split(token)
    return pieces[0] + "".join(f + rest for f, rest in zip(fills, pieces[1:], strict=True))


def tokenize_media(
    tokenizer: Any, text: str, type_of: Mapping[int, int], ignored: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`tokenize_chat` plus ``types [L]`` int64 (``type_of[id]`` on media tokens, else 0).
    Media tokens and the ``ignored`` ids (markers) are not supervised; a sample left with no
    supervised token is refused."""
    ids, labels = tokenize_chat(tokenizer, text)  # [L], [L]
    types = np.zeros_like(ids)
    for token_id, kind in type_of.items():
        types[ids == token_id] = kind
    labels[(types != 0) | np.isin(ids, ignored)] = IGNORE_INDEX
    if not (labels != IGNORE_INDEX).any():
        raise BadRecordError("no_assistant", "no supervised token after templating")
    return ids, labels, types
