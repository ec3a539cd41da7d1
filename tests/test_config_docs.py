"""Every config key is documented (docs/config.md is current) and reaches its package."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from lmms_train.config import DatasetConfig, TrainConfig, render_config_docs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _all_fields(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield cls, f
        for arg in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(arg):
                yield from _all_fields(arg)


def test_every_key_has_a_doc():
    missing = [
        f"{c.__name__}.{f.name}" for c, f in _all_fields(TrainConfig) if not f.metadata.get("doc")
    ]
    assert not missing, missing


def test_docs_page_is_current():
    assert DOCS.read_text() == render_config_docs(), "regenerate: lmms-train docs > docs/config.md"


def test_dataset_section_covers_lmms_data():
    """Every lmms_data.DatasetConfig key can be set from the trainer's dataset_config."""
    import lmms_data

    theirs = {f.name for f in dataclasses.fields(lmms_data.DatasetConfig)}
    ours = {f.name for f in dataclasses.fields(DatasetConfig)}
    assert theirs <= ours, sorted(theirs - ours)
