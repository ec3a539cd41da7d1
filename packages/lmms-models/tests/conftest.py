"""Test setup for lmms-models: single-threaded torch (2 shared cores); one 2-rank gloo spawn per
session for every module that names a TWO_RANK_WORKER (_two_ranks.py)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # spawned workers import the test helpers by name


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def two_ranks(request):
    """``results(worker)``: each rank's result of `worker` ("module:function"), from one 2-rank
    spawn that runs the workers of every selected test module using this fixture."""
    import _two_ranks

    from lmms_parallel.testing import spawn_ranks

    targets = sorted({item.module.TWO_RANK_WORKER for item in request.session.items
                      if "two_ranks" in item.fixturenames})  # fmt: skip
    ranks = spawn_ranks(_two_ranks.run, 2, targets)

    def results(worker: str) -> list[dict]:
        got = [r[worker] for r in ranks]
        for rank, r in enumerate(got):
            assert not (isinstance(r, dict) and r.keys() == {"error"}), f"rank {rank}: {r['error']}"
        return got

    return results
