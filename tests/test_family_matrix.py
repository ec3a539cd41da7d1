"""benchmarks/device/family_matrix.py without a GPU: every registered family has the tiny example
the matrix trains, and the table marks failing rows (the full plumbing: `--cpu --tiny`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _matrix():
    path = REPO / "benchmarks" / "device" / "family_matrix.py"
    spec = importlib.util.spec_from_file_location("family_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_registered_family_has_a_tiny_example_for_the_matrix(tmp_path):
    from lmms_models import list_models

    fm = _matrix()
    for name in list_models():
        example, _raw, over = fm._inputs(name, tmp_path)
        assert example.parent.name == name and "tiny" in example.name
        assert all(str(tmp_path) in o for o in over), over  # data and processor under work/


def test_table_marks_failures():
    fm = _matrix()
    rows = [
        {"family": "a", "rel_diff": 1e-3, "parity_ok": True, "loss_first": 7.0, "loss_last": 5.0,
         "tokens_per_s": 1e5, "peak_gib": 1.5, "train_ok": True},
        {"family": "b", "rel_diff": 0.5, "parity_ok": False, "loss_first": 7.0, "loss_last": 5.0,
         "train_ok": True},
        {"family": "c", "parity_ok": False, "train_ok": False, "train_error": "unavailable"},
    ]  # fmt: skip
    lines = fm.table(rows, 2e-2).splitlines()[2:]
    assert lines[0].startswith(
        "| a | PASS 1.0e-03 / 2e-02 | 7.000 -> 5.000 | 100,000 | 1.50 | pass"
    )
    assert "FAIL 5.0e-01" in lines[1] and lines[1].endswith("| FAIL |")
    assert "ERROR unavailable" in lines[2] and lines[2].endswith("| FAIL |")
