"""Preference pairs (``dataset_type: preference``, the DPO objective): records -> one sample that
holds the chosen and the rejected document.

Accepted layouts (the common ones of TRL, LLaMA-Factory and ms-swift):

* ``{"prompt", "chosen", "rejected"}``, each a string or a message list (``prompt``: user/system
  turns; ``chosen``/``rejected``: the assistant turn(s)), media as columns (``images``,
  ``videos``, ``audios``) filling the prompt's media parts, or, for a string prompt, placed before
  its text (``<image>`` tags in the string place them instead, LLaVA-style);
* ``{"chosen": messages, "rejected": messages}``: two whole conversations whose shared leading
  turns are the prompt (TRL's implicit prompt).

Message lists may be JSON strings (Parquet columns). Precomputed reference log-probabilities
(``ref_chosen_logps``, ``ref_rejected_logps``: the sums over each answer's tokens, as the DPO
objective computes them) ride along as the sample's ``ref_logps [2]``. The pair becomes one sample of two documents
(``segments [len_chosen, len_rejected]``): each document is the whole prompt (with its media) and
one answer, so each attends only to itself and the two stay in the same packed row; the prompt and
its media are encoded twice (the simplest exact layout: no attention mask beyond per-document
causal attention, no cross-document position bookkeeping).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from lmms_data._errors import BadRecordError
from lmms_data._registry import register_dataset

__all__ = ["pair_sample", "preference"]

_MEDIA_COLUMNS = ("images", "image", "videos", "video", "audios", "audio")
_TAG = re.compile(r"<(image|video|audio)>")
#: sample entries concatenated along their last axis (tokens) / first axis (media rows)
_TOKEN_AXIS = ("input_ids", "labels", "position_ids", "mm_token_type_ids")
_COUNTS = ("length", "vision_tokens", "audio_tokens")


def _messages(value: Any, role: str, what: str) -> list[dict[str, Any]]:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BadRecordError("malformed_json", f"{what}: {e}") from None
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list) or not value:
        raise BadRecordError("malformed_record", f"{what} must be a string or a message list")
    return list(value)


def _string_prompt(text: str, media: dict[str, Any]) -> list[dict[str, Any]]:
    """A string prompt as one user turn: ``<image>`` tags become media parts where they stand;
    without tags, one part per media column entry goes before the text."""
    parts: list[dict[str, Any]] = []
    if _TAG.search(text):
        pos = 0
        for m in _TAG.finditer(text):
            if text[pos : m.start()].strip():
                parts.append({"type": "text", "text": text[pos : m.start()]})
            parts.append({"type": m.group(1)})
            pos = m.end()
        if text[pos:].strip():
            parts.append({"type": "text", "text": text[pos:]})
    else:
        for col, values in media.items():
            kind = col.rstrip("s")
            n = len(values) if isinstance(values, list | tuple | np.ndarray) else 1
            parts += [{"type": kind} for _ in range(n)]
        parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


@register_dataset("preference")
def preference(record: dict[str, Any]) -> dict[str, Any]:
    """A preference record -> ``{"pair": (chosen record, rejected record)}`` of chat records."""
    if record.get("chosen") is None or record.get("rejected") is None:
        raise BadRecordError(
            "malformed_record",
            f"a preference record needs 'chosen' and 'rejected' (keys: {sorted(record)[:8]})",
        )
    media = {k: record[k] for k in _MEDIA_COLUMNS if record.get(k) is not None}
    chosen = _messages(record["chosen"], "assistant", "chosen")
    rejected = _messages(record["rejected"], "assistant", "rejected")
    prompt_value = record.get("prompt")
    if prompt_value is None:  # two whole conversations: the shared leading turns are the prompt
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        if k == 0:
            raise BadRecordError("malformed_record", "chosen and rejected share no prompt turn")
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    elif isinstance(prompt_value, str) and not prompt_value.lstrip().startswith("["):
        prompt = _string_prompt(prompt_value, media)
    else:
        prompt = _messages(prompt_value, "user", "prompt")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in answer):
            raise BadRecordError("no_assistant", f"{name} has no assistant turn")
    out: dict[str, Any] = {
        "pair": tuple({"messages": prompt + answer, **media} for answer in (chosen, rejected))
    }
    refs = [record.get("ref_chosen_logps"), record.get("ref_rejected_logps")]
    if any(r is not None for r in refs):
        try:
            out["ref_logps"] = [float(r) for r in refs]  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise BadRecordError(
                "malformed_record", "ref_chosen_logps and ref_rejected_logps must both be numbers"
            ) from None
    return out


def pair_sample(
    chosen: dict[str, Any], rejected: dict[str, Any], ref_logps: list[float] | None = None
) -> dict[str, Any]:
    """One sample of the two documents (chosen first), ``segments`` their lengths, and the
    precomputed reference log-probabilities if given."""
    from lmms_data._collate import MEDIA_KEYS

    known = {*_TOKEN_AXIS, *_COUNTS, *MEDIA_KEYS}
    other = sorted((set(chosen) | set(rejected)) - known)
    if other:
        raise BadRecordError(
            "unsupported_pair", f"this processor's samples carry {other}: not pairable"
        )
    out: dict[str, Any] = {}
    for key in _TOKEN_AXIS:
        if key in chosen or key in rejected:
            if (chosen.get(key) is None) != (rejected.get(key) is None):
                raise BadRecordError("unsupported_pair", f"only one document has {key}")
            if chosen.get(key) is not None:
                out[key] = np.concatenate([np.asarray(chosen[key]), np.asarray(rejected[key])], -1)
    for key in MEDIA_KEYS:
        vals = [np.asarray(s[key]) for s in (chosen, rejected) if s.get(key) is not None]
        if vals:
            out[key] = np.concatenate(vals)
    for key in _COUNTS:
        if key in chosen or key in rejected:
            out[key] = int(chosen.get(key, 0)) + int(rejected.get(key, 0))
    out["segments"] = [int(chosen["length"]), int(rejected["length"])]
    if ref_logps is not None:
        out["ref_logps"] = np.asarray(ref_logps, dtype=np.float64)
    return out
