"""Chat records: normalisation (OpenAI / Qwen-VL ``messages``, LLaVA ``conversations``) and media.

The normalised record is ``{"messages": [{"role", "content": [part, ...]}, ...]}`` where a part is
``{"type": "text", "text": str}`` or ``{"type": "image" | "video" | "audio", <type>: Media}`` and a
``Media`` is bytes or an absolute path checked to exist (and to stay inside ``data_folder``).
OpenAI-style parts map onto these: ``image_url`` / ``input_image`` (a path, ``file://`` URL or
``data:`` URL), ``video_url``, ``audio_url``, ``input_audio`` (``{"data": base64, "format"}``) and
``input_text`` / ``output_text``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from typing import Any

from lmms_data._errors import BadRecordError
from lmms_data._media import VIDEO_PART_OPTIONS

MEDIA_TYPES = ("image", "video", "audio")
ROLES = ("system", "user", "assistant", "tool")
_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "system": "system"}  # fmt: skip
_LLAVA_TAG = re.compile(r"<(image|video|audio)>")
_TEXT_PARTS = ("text", "input_text", "output_text")
_OPENAI_PARTS = {"image_url": "image", "input_image": "image", "video_url": "video",
                 "audio_url": "audio", "input_audio": "audio"}  # fmt: skip
_ROLE_ALIASES = {"developer": "system"}
#: the record shapes the built-in ``chat`` adapter understands, named in shape errors
ACCEPTED_RECORDS = (
    '{"messages": [{"role", "content": str | [parts]}]} (OpenAI / Qwen-VL; parts text, image, '
    'video, audio, image_url, input_audio), or {"conversations": [{"from", "value"}], "image": ...}'
    " (LLaVA / ShareGPT); other shapes need a registered dataset_type"
)


def _b64(data: Any, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise BadRecordError("malformed_record", f"{what} is not valid base64") from None


def _openai_media(part: dict[str, Any], t: str) -> Any:
    """The media value of an OpenAI-style part (a path / URL string, or decoded bytes)."""
    value = part.get(t)
    if t == "input_image" and value is None:
        value = part.get("image_url")
    if isinstance(value, dict):
        if value.get("url") is not None:
            value = value["url"]
        elif value.get("data") is not None:  # input_audio: {"data": base64, "format": "wav"}
            value = _b64(value["data"], f"{t}.data")
    if value is None:
        raise BadRecordError("malformed_record", f"{t} part carries no url/data")
    return value


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


def from_llava(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """LLaVA ``conversations`` with ``<image>`` tags -> messages with content parts."""
    media = {
        t: _as_list(rec.get(t) if rec.get(t) is not None else rec.get(t + "s")) for t in MEDIA_TYPES
    }
    used = dict.fromkeys(MEDIA_TYPES, 0)
    messages = []
    for turn in rec["conversations"]:
        if not isinstance(turn, dict) or "value" not in turn:
            raise BadRecordError("malformed_record", "a conversations turn lacks 'value'")
        role = _LLAVA_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise BadRecordError("malformed_record", f"unknown LLaVA role {turn.get('from')!r}")
        parts: list[dict[str, Any]] = []
        pieces = _LLAVA_TAG.split(str(turn["value"]))
        for i, piece in enumerate(pieces):
            if i % 2 == 1:
                if used[piece] >= len(media[piece]):
                    raise BadRecordError(
                        "media_mismatch",
                        f"more <{piece}> tags than {piece} entries ({len(media[piece])})",
                    )
                parts.append({"type": piece, piece: media[piece][used[piece]]})
                used[piece] += 1
            elif piece.strip("\n"):
                parts.append(
                    {"type": "text", "text": piece.strip("\n") if i else piece.rstrip("\n")}
                )
        messages.append({"role": role, "content": parts})
    for t in MEDIA_TYPES:
        if used[t] != len(media[t]):
            raise BadRecordError(
                "media_mismatch", f"{len(media[t])} {t} entries but {used[t]} <{t}> tags"
            )
    return messages


def _normalise_messages(rec: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = rec["messages"]
    if isinstance(msgs, str):  # Parquet/Arrow datasets often store messages as a JSON string
        try:
            msgs = json.loads(msgs)
        except ValueError as e:
            raise BadRecordError("malformed_json", f"messages column: {e}") from None
    if not isinstance(msgs, list):
        raise BadRecordError("malformed_record", "messages must be a list")
    # media given as columns ("images": [bytes, ...]) fill parts that carry no value, in order
    columns = {
        t: _as_list(rec.get(t + "s") if rec.get(t + "s") is not None else rec.get(t))
        for t in MEDIA_TYPES
    }
    used = dict.fromkeys(MEDIA_TYPES, 0)
    out = []
    for m in msgs:
        role = _ROLE_ALIASES.get(m.get("role"), m.get("role")) if isinstance(m, dict) else None
        if role not in ROLES:
            raise BadRecordError("malformed_record", f"bad message {str(m)[:80]!r}")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise BadRecordError("malformed_record", "message content must be a string or a list")
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise BadRecordError("malformed_record", "content part is not an object")
            t = part.get("type")
            if t in _TEXT_PARTS:
                parts.append({"type": "text", "text": str(part.get("text") or "")})
            elif t in _OPENAI_PARTS:
                kind = _OPENAI_PARTS[t]
                parts.append({"type": kind, kind: _openai_media(part, t)})
            elif t in MEDIA_TYPES:
                value = part.get(t)
                if value is None:  # Arrow structs fill absent keys with None
                    value = part.get(f"{t}_url") or part.get("url") or part.get("path")
                if value is None:
                    if used[t] >= len(columns[t]):
                        raise BadRecordError(
                            "media_mismatch", f"more {t} parts than entries in the {t}s column"
                        )
                    value = columns[t][used[t]]
                    used[t] += 1
                own = {k: part[k] for k in VIDEO_PART_OPTIONS if part.get(k) is not None}
                parts.append({"type": t, t: value, **(own if t == "video" else {})})
            else:
                known = sorted({*_TEXT_PARTS, *MEDIA_TYPES, *_OPENAI_PARTS})
                raise BadRecordError(
                    "malformed_record", f"unknown content part type {t!r} (known: {known})"
                )
        out.append({"role": role, "content": parts})
    for t in MEDIA_TYPES:
        # a media column must be used fully, unless the parts carry their own (inline) media
        if columns[t] and used[t] != len(columns[t]) and (used[t] > 0 or not _has_inline(out, t)):
            raise BadRecordError(
                "media_mismatch",
                f"{len(columns[t])} {t}s in the column but {used[t]} {t} parts use them",
            )
    return out


def _has_inline(messages: list[dict], t: str) -> bool:
    return any(p["type"] == t for m in messages for p in m["content"])


def check_text(text: Any, what: str) -> str:
    """``text`` if it is a string of valid Unicode; else a ``malformed_record`` bad record (a
    JSON ``"\\ud800"`` escape decodes to a lone surrogate, which no tokenizer can encode)."""
    if not isinstance(text, str):
        raise BadRecordError(
            "malformed_record", f"{what} must be a string, got {type(text).__name__}"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecordError(
            "malformed_record",
            f"{what} is not valid Unicode: {text[e.start : e.end]!r} (a lone surrogate) at "
            f"character {e.start}",
        ) from None
    return text


def normalise(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Any supported record -> validated messages (media values not yet resolved)."""
    if rec.get("messages") is not None:
        messages = _normalise_messages(rec)
    elif rec.get("conversations") is not None:
        messages = from_llava(rec)
    else:
        raise BadRecordError(
            "malformed_record",
            f"no 'messages' or 'conversations' (keys: {sorted(rec)[:8]}); accepted: {ACCEPTED_RECORDS}",
        )
    for m in messages:
        for p in m["content"]:
            if p["type"] == "text":
                check_text(p["text"], f"{m['role']} text")
    if not any(p["type"] != "text" or p["text"].strip() for m in messages for p in m["content"]):
        raise BadRecordError("empty_conversation", "the conversation has no content")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise BadRecordError("no_assistant", "no assistant turn to supervise")
    return messages


def resolve_media(value: Any, kind: str, base: str, *, allow_absolute: bool) -> bytes | str:
    """Bytes stay bytes; a path becomes absolute, must exist and must not escape ``base``."""
    if isinstance(value, dict):  # HF Image/Video feature: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise BadRecordError("malformed_record", f"{kind} value must be a path or bytes")
    if value.startswith("data:"):  # data:[<mime>][;base64],<payload>
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise BadRecordError("malformed_record", f"{kind} data URL is not base64")
        return _b64(payload, f"{kind} data URL")
    if value.startswith(("http://", "https://")):
        raise BadRecordError(
            "missing_media",
            f"{kind} {value[:80]!r} is a remote URL: lmms reads local files (download the media "
            "and give paths relative to data_folder)",
        )
    if value.startswith("file://"):
        value = value[len("file://") :]
    base = os.path.realpath(base)
    if os.path.isabs(value):
        if not allow_absolute:
            raise BadRecordError(
                "missing_media",
                f"absolute {kind} path {value!r} refused (set allow_absolute_paths)",
            )
        path = os.path.realpath(value)
    else:
        path = os.path.realpath(os.path.join(base, value))
        if not allow_absolute and os.path.commonpath([base, path]) != base:
            raise BadRecordError(
                "missing_media", f"{kind} path {value!r} escapes data_folder {base}"
            )
    if not os.path.isfile(path):
        raise BadRecordError("missing_media", f"{kind} file {path} not found")
    return path
