"""Shared fixtures of lmms-train's own tests: the config of a tiny Qwen2 text run and the steps
it logged. The run's synthetic records and local tokenizer are made by the trainer on first use
(`generate_synthetic`, `build_local_processor`) in one folder for the whole session."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def text_inputs(tmp_path_factory) -> Path:
    """The folder of the text runs' data and tokenizer (written by the first run)."""
    return tmp_path_factory.mktemp("text_inputs")


@pytest.fixture
def text_config(text_inputs, tmp_path) -> Callable[..., dict]:
    """`text_config(out, packing_length=256, **trainer_args)`: a config dict training a tiny
    Qwen2 from its config on 96 synthetic text records, 3 steps into `tmp_path / out`."""

    def make(out: str, *, packing_length: int = 256, **trainer: object) -> dict:
        return {
            "model_config": {
                "load_from_config": {"model_type": "qwen2", "tiny": True},
                "processor_path": str(text_inputs / "processor"),
                "build_local_processor": True,
            },
            "dataset_config": {
                "dataset_path": str(text_inputs / "data"),
                "generate_synthetic": {"kind": "text", "num_samples": 96, "seed": 0},
                "packing": True, "packing_length": packing_length, "num_workers": 0,
            },
            "trainer_args": {
                "output_dir": str(tmp_path / out), "max_steps": 3, "learning_rate": 3e-3,
                "bf16": False, "eval_steps": 0, "report_to": [], "seed": 0, **trainer,
            },
        }  # fmt: skip

    return make


@pytest.fixture
def logged_steps(tmp_path) -> Callable[[str], list[dict]]:
    """`logged_steps(out)`: the rows with a loss of `tmp_path / out / metrics.jsonl`."""

    def read(out: str) -> list[dict]:
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "loss" in r]

    return read
