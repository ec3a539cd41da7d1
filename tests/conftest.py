"""Shared fixture of the end-to-end trainer tests: one tiny dataset + processor per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for e2e_helpers (tests use importlib mode)


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory) -> dict[str, str]:
    """A 96-record synthetic dataset and a local processor, generated once."""
    from lmms_data import build_local_processor, generate_synthetic_vl

    root = tmp_path_factory.mktemp("tiny_inputs")
    generate_synthetic_vl(str(root / "data"), 96, format="parquet", seed=0)
    build_local_processor(str(root / "processor"), "qwen2_5_vl")
    return {"data": str(root / "data"), "processor": str(root / "processor")}
