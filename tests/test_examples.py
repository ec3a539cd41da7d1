"""Every example config parses and validates (unknown keys or bad values would fail here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmms_train.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"))
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl")


def test_every_family_has_examples():
    names = {p.parent.name for p in EXAMPLES}
    assert set(FAMILIES) <= names, set(FAMILIES) - names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.trainer_args.max_steps > 0
