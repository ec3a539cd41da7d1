"""Ulysses SP 2 and 4 equal SP 1 for every VL family (loss and gradients, gloo on CPU).

Qwen3-VL's deepstack features sit at visual positions of the whole row; under SP they must follow
the row's slicing (``DeepstackAtPositions.sp_slice``), from the host merge and from upstream's
own boolean-mask merge alike. With the vision work split across the SP ranks
(``lmms_parallel.SplitVision``) every rank encodes a share of the images and frames and the
gradients still equal SP 1. One 4-process spawn runs every scenario (see _sp_workers.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _sp_workers

from lmms_parallel.testing import spawn_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_ranks(_sp_workers.run, 4)


@pytest.mark.parametrize("case", [f"{n}/{label}" for n, label, _ in _sp_workers.SCENARIOS])
@pytest.mark.parametrize("sp", [2, 4])
def test_sp_matches_sp1(results, case, sp):
    for rank, res in enumerate(results):
        got = res[case]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        run = got[f"sp{sp}"]
        assert run["loss"] == pytest.approx(got["loss_sp1"], rel=1e-5, abs=1e-6), rank
        assert run["same_params"], rank
        assert run["worst_rel_grad"] < 1e-4, (rank, run["worst_rel_grad"])
        if case.endswith("/split"):  # every rank encoded a share (the last tower call's)
            assert len(run["shares"]) == sp and min(run["shares"]) > 0, run["shares"]
        if case.endswith("/split_few") and sp == 4:  # 2 images for 4 ranks: 2 empty shares
            assert sorted(run["shares"])[:2] == [0.0, 0.0], run["shares"]


def test_lora_fsdp2_matches_one_process(results):
    """Adapters under FSDP2 (2 ranks, meta-device build, weights broadcast) == one process."""
    for rank, res in enumerate(results):
        got = res["lora_fsdp"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["loss"] == pytest.approx(got["loss_sp1"], rel=1e-5, abs=1e-6), rank
        assert got["same_params"], rank
        assert got["worst_rel_grad"] < 1e-4, (rank, got["worst_rel_grad"])


@pytest.mark.parametrize("sp", [2, 4])
def test_dpo_sp_matches_sp1(results, sp):
    """DPO on packed pairs with images under Ulysses SP == SP 1 (loss, adapter gradients)."""
    for rank, res in enumerate(results):
        got = res["dpo_sp"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        run = got[f"sp{sp}"]
        assert run["loss"] == pytest.approx(got["loss_sp1"], rel=1e-5, abs=1e-6), rank
        assert run["same_params"], rank
        assert run["worst_rel_grad"] < 1e-4, (rank, run["worst_rel_grad"])
