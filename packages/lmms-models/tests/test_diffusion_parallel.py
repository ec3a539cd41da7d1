"""Diffusion transformers across layouts on CPU (gloo): Ulysses SP 2 == SP 1 for wan (3-D RoPE
positions over a token split inside a frame), FSDP2 on 2 ranks == 1 process for sit and wan
(losses and gradients). One 2-process spawn runs every case (see _diffusion_workers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("diffusers")


pytestmark = pytest.mark.multiprocess


TWO_RANK_WORKER = "_diffusion_workers:run"  # run in conftest's session-wide 2-rank spawn


@pytest.fixture(scope="module")
def results(two_ranks) -> list[dict]:
    return two_ranks(TWO_RANK_WORKER)


def test_wan_ulysses_sp2_equals_sp1(results) -> None:
    for rank, res in enumerate(results):
        got = res["sp/wan"]
        assert "error" not in got, got.get("error")
        assert got["loss"] == pytest.approx(got["loss_sp1"], rel=1e-5), rank
        assert got["worst"] < 1e-4, (rank, got["worst"])
        assert got["restored"], "WanUlysses.remove() must restore the single-process forward"


@pytest.mark.parametrize("family", ["sit", "wan"])
def test_fsdp2_two_ranks_equal_one_process(results, family) -> None:
    for rank, res in enumerate(results):
        got = res[f"fsdp/{family}"]
        assert "error" not in got, got.get("error")
        assert got["loss"] == pytest.approx(got["loss_1proc"], rel=1e-5), rank
        assert got["worst"] < 1e-4, (rank, got["worst"])


def test_frozen_text_encoder_sharded_or_offloaded_equals_replicated(results) -> None:
    """``frozen_encoders: shard`` (FSDP2 over 2 ranks) and ``offload`` give the replicated umT5's
    states exactly; sharded block weights are DTensors; nothing takes gradients."""
    for rank, res in enumerate(results):
        got = res["encoders/wan"]
        assert "error" not in got, got.get("error")
        assert got["nonzero"], rank
        assert got["shard/worst"] == 0.0 and got["offload/worst"] == 0.0, (rank, got)
        assert got["shard/dtensor"] and not got["replicate/dtensor"], rank
        assert not any(got[f"{m}/grads"] for m in ("replicate", "shard", "offload")), rank
