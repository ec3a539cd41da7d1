"""Linear-attention families under Ulysses SP 2 and FSDP2 (2 ranks, full activation
checkpointing) equal one process: loss and gradients (gloo on CPU; see _linear_workers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _linear_workers

pytestmark = pytest.mark.multiprocess


TWO_RANK_WORKER = "_linear_workers:run"  # run in conftest's session-wide 2-rank spawn


@pytest.fixture(scope="module")
def results(two_ranks) -> list[dict]:
    return two_ranks(TWO_RANK_WORKER)


@pytest.mark.parametrize("name", _linear_workers.FAMILIES)
def test_sp2_matches_sp1(results, name):
    for rank, res in enumerate(results):
        got = res[f"{name}/sp2"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["tokens"] % 2 == 1  # the row needed SP padding
        assert got["loss"] == pytest.approx(got["loss_sp1"], rel=1e-5, abs=1e-6), rank
        assert got["same_params"], rank
        assert got["worst_rel_grad"] < 1e-4, (rank, got["worst_rel_grad"])


@pytest.mark.parametrize("name", _linear_workers.FAMILIES)
def test_fsdp2_with_checkpointing_matches_one_process(results, name):
    for rank, res in enumerate(results):
        got = res[f"{name}/fsdp2_ac"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["loss"] == pytest.approx(got["loss_1proc"], rel=1e-5, abs=1e-6), rank
        assert got["same_params"], rank
        assert got["worst_rel_grad"] < 1e-4, (rank, got["worst_rel_grad"])
