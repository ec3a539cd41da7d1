"""Shared by the processors: load a tokenizer, tokenise a rendered chat, label assistant turns.

Labels are the tokens of assistant turns (their text and the closing ``<|im_end|>``), found by
character offsets in the templated text, so the rule holds for any tokenizer of the Qwen chat
format (``<|im_start|>role\\n ... <|im_end|>``) and of the LLaMA-3 chat format that LLaDA's
tokenizer uses (``<|start_header_id|>assistant<|end_header_id|>\\n\\n ... <|eot_id|>``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

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
