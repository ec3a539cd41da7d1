"""Built-in dataset types (record adapters) for the dataset registry."""

from __future__ import annotations

from typing import Any

from lmms_data._registry import register_dataset


@register_dataset("chat")
def chat(record: dict[str, Any]) -> dict[str, Any]:
    """OpenAI / Qwen-VL ``messages`` records, or LLaVA ``conversations`` (auto-detected)."""
    return record


register_dataset("vision")(chat)  # the name other engines use for the same records
