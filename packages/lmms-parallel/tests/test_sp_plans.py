"""Sequence-parallel plans (lmms_parallel.apply_sp): the token styles on a toy transformer laid
out as diffusers' attention, SP 2 == one process in loss and gradients, the handle restoring the
model bit for bit, and the refusals (tokens or heads that do not split). One 2-rank spawn
(_sp_plan_workers.py); the families' plans are checked in lmms-models (Wan, BAGEL)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import lmms_parallel as lp


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    import _sp_plan_workers

    from lmms_parallel.testing import spawn_ranks

    return spawn_ranks(_sp_plan_workers.run, 2)


@pytest.mark.multiprocess
def test_token_styles_sp2_equal_one_process_and_remove_restores(ranks):
    for rank, res in enumerate(ranks):
        got = res["tokens"]
        assert "error" not in got, got.get("error")
        assert got["loss"] == pytest.approx(got["ref"], rel=1e-6), rank
        assert got["worst"] < 1e-5, (rank, got["worst"])
        assert got["restored"], rank
        assert got["modules"] == 3 + 5 * 2  # blocks.0, norm_out, proj_out + 5 per block
        assert "7 tokens do not split over sp=2" in got["odd"], got["odd"]


@pytest.mark.multiprocess
def test_heads_that_do_not_split_are_refused(ranks):
    for res in ranks:
        assert "3 attention heads cannot be split over sp=2" in res["heads"]["error_text"]


def test_sp_styles_are_registered_and_unknown_ones_named():
    assert {"sp_split_tokens", "sp_gather_tokens", "sp_row_stack"} <= set(
        lp.registered_styles("sp")
    )
    from torch import nn

    with pytest.raises(KeyError, match="unknown sp style 'sp_nope'"):
        lp.apply_sp(nn.Sequential(nn.Linear(2, 2)), {"0": "sp_nope"}, None)
