"""Expert and tensor parallelism from the specs' plans == one process (gloo, CPU).

Two spawns (2 and 4 ranks) run every scenario of _ep_tp_workers.py: EP 2 and 4, FSDP 2 x EP 2,
EP 2 with Ulysses SP 2, TP 2, TP 2 x FSDP 2, with AdamW and Muon, three optimizer steps each,
Qwen3-MoE / Qwen3-VL-MoE (router aux loss on, a text-only rank next to image ranks) and Qwen3 /
Qwen3-VL (TP), Qwen3.5-MoE (the same EP plan on another family); plus one experts module whose EP rank receives no token at all.

Gradients are clipped to a global norm of 1 (lmms_parallel.clip_grad_norm_ over parameters on
different meshes, EP slices counted once) against torch's on the whole model.

Tolerances: losses, gradient norms and step-1 gradients within fp32 summation order. Parameters after three
steps: AdamW within 5e-3 of the largest entry (Adam's normalisation turns fp32-order differences
of near-zero gradients into lr-sized steps); Muon within 0.15 (bf16 Newton-Schulz of the tiny,
near rank-deficient gradients maps such differences to O(1) directions); the exactness of Muon's
whole-matrix path for TP shards is checked on its own (``muon_tp_exact``: bit-identical).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.multiprocess


def _spawn(world: int, names: list[str], out: Path) -> list[dict]:
    import _ep_tp_workers as W
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(W.run, args=(world, port, str(out), names), nprocs=world, join=True)
    return [json.loads((out / f"ep_tp_rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    import _ep_tp_workers as W

    return _spawn(2, W.WORLD_2, tmp_path_factory.mktemp("ep_tp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    import _ep_tp_workers as W

    return _spawn(4, W.WORLD_4, tmp_path_factory.mktemp("ep_tp4"))


def _check(results: list[dict], name: str) -> None:
    for rank, res in enumerate(results):
        assert "error" not in res[name], f"rank {rank}: {res[name]['error']}"
    r = results[0][name]
    muon = "muon" in name
    tol = 1e-4 if muon else 1e-5
    for got, ref in zip(r["losses"], r["ref"], strict=True):
        assert abs(got - ref) <= tol * abs(ref), (name, r["losses"], r["ref"])
    # the first norm is the same gradient's; later ones follow the updates (Muon: see above)
    for i, (got, ref) in enumerate(zip(r["norms"], r["ref_norms"], strict=True)):
        bound = 1e-5 if i == 0 else (1e-2 if muon else 1e-4)
        assert abs(got - ref) <= bound * ref, (name, r["norms"], r["ref_norms"])
    assert r["ref_norms"][0] > 1.0  # the clip is active
    for other in results[1:]:
        assert other[name]["losses"] == r["losses"]  # every rank logs the same loss
        assert other[name]["norms"] == r["norms"]  # ... and clips by the same norm
    assert r["grad_err"][0] < 1e-5, (name, r["grad_err"])
    assert r["export_keys_ok"] and r["export_err"] == 0.0, name  # gather_full_state_dict
    assert r["param_err"][0] < (0.15 if muon else 5e-3), (name, r["param_err"])


@pytest.mark.parametrize(
    "name",
    ["ep2_vl_adamw", "ep2_moe_muon", "ep2_sp2_moe", "ep2_qwen3_5_moe", "tp2_vl_muon"],
)
def test_two_ranks_match_one_process(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", ["ep4_moe", "fsdp2_ep2_vl", "tp2_fsdp2_qwen3"])
def test_four_ranks_match_one_process(world4, name):
    _check(world4, name)


def test_an_ep_rank_without_tokens_takes_part(world2):
    for rank, res in enumerate(world2):
        r = res["ep_zero_tokens"]
        assert "error" not in r, r
        for case in ("zero", "uneven"):
            assert r[case]["out"] < 1e-5, (rank, case, r)
            assert r[case]["grad"] < 1e-4, (rank, case, r)
            assert r[case]["grad_present"], (rank, case)


def test_muon_orthogonalises_tp_shards_as_whole_matrices(world2):
    for res in world2:
        r = res["muon_tp_exact"]
        assert "error" not in r, r
        assert r["max_diff"] == 0.0, r  # bit-identical to NS of the whole matrix
        assert r["shard_rows"] != r["full_rows"] or r["shard_cols"] != r["full_cols"]


def _check_resume(results: list[dict], name: str) -> None:
    """DCP save after step 2 of the parallel run; the same layout resumes to the straight run's
    step-3 loss and parameters, and one process (EP 1 / TP 1, no FSDP) resumes from the same
    checkpoint to the same step-3 loss (within fp32 summation order of the other layout)."""
    for rank, res in enumerate(results):
        assert "error" not in res[name], f"rank {rank}: {res[name]['error']}"
    r = results[0][name]
    straight, resumed = r["losses"][2:], r["resumed"]
    muon = "muon" in name
    assert resumed["losses"] == straight, (name, resumed["losses"], straight)
    assert resumed["param_err"] == 0.0, (name, resumed["param_err"])
    for got, ref in zip(resumed["one_losses"], straight, strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref), (name, resumed["one_losses"], straight)
    assert resumed["one_param_err"] < (0.15 if muon else 5e-3), (name, resumed)


@pytest.mark.parametrize("name", ["ep2_vl_adamw", "ep2_moe_muon"])
def test_two_ranks_checkpoint_resumes_at_degree_one(world2, name):
    _check_resume(world2, name)


def test_fsdp2_ep2_checkpoint_resumes_at_degree_one(world4):
    _check_resume(world4, "fsdp2_ep2_vl")
