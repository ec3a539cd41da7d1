"""Expert and tensor parallelism from the specs' plans == one process (gloo, CPU).

Two spawns (2 and 4 ranks) run every scenario of _ep_tp_workers.py: EP 2 and 4, FSDP 2 x EP 2,
EP 2 with Ulysses SP 2, TP 2, TP 2 x FSDP 2, with AdamW and Muon, three optimizer steps each,
Qwen3-MoE / Qwen3-VL-MoE (router aux loss on, a text-only rank next to image ranks) and Qwen3 /
Qwen3-VL (TP), Qwen3.5-MoE (the same EP plan on another family); plus one experts module whose EP rank receives no token at all.

TP runs split the LM head over the vocabulary (the loss never gathers [T, vocab]);
``tp2_sp_qwen2_5_vl``, ``tp2_sp_qwen3_vl`` and ``tp2_fsdp2_qwen3`` also keep the residual
stream split over the sequence (sequence-parallel norms; uneven token counts per rank; the
vision merge before the split; Qwen3-VL's deepstack added on each rank's rows).

Checkpoints (DCP, saved after step 2): every layout resumes bit for bit (EP 2, EP 4, FSDP 2 x
EP 2, TP 2, TP 2 x FSDP 2) and one process resumes each to the same step-3 loss; the 4-rank
checkpoints also resume on 2 ranks at other degrees (EP 4 -> 2 with FSDP 4 -> 2, TP 2 x FSDP 2
-> FSDP 2) in a second process group of the same spawn. The trainer's HF export of a TP and an
FSDP x EP run loads in transformers with the run's weights and logits, exactly.

Gradients are clipped to a global norm of 1 (lmms_parallel.clip_grad_norm_ over parameters on
different meshes, EP slices counted once) against torch's on the whole model.

Tolerances: losses, gradient norms and step-1 gradients within fp32 summation order. Parameters after three
steps: AdamW within 5e-3 of the largest entry (Adam's normalisation turns fp32-order differences
of near-zero gradients into lr-sized steps); Muon within 0.15 (bf16 Newton-Schulz of the tiny,
near rank-deficient gradients maps such differences to O(1) directions); the exactness of Muon's
whole-matrix path for TP shards is checked on its own (``muon_tp_exact``: bit-identical).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.multiprocess


def _spawn(world: int, names: list[str], out: Path) -> list[dict]:
    import _ep_tp_workers as W

    from lmms_parallel.testing import free_port, spawn_ranks

    # free_port(): the 2-rank group resuming 4-rank checkpoints
    return spawn_ranks(W.run, world, free_port(), str(out), names, timeout_s=120)


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
    [
        "ep2_vl_adamw",
        "ep2_moe_muon",
        "ep2_sp2_moe",
        "ep2_qwen3_5_moe",
        "tp2_vl_muon",
        "tp2_sp_qwen2_5_vl",
        "tp2_sp_qwen3_vl",
    ],
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


def test_sp_deepstack_adds_each_ranks_rows_as_upstream_on_the_whole_row(world2):
    """``sp_deepstack`` (TP + sequence-parallel norms, Qwen3-VL): each rank adds the deepstack
    features of the visual positions inside its rows (19 / 18 of 37), given a boolean mask or
    long positions (out of order, or all on rank 0's rows), == upstream's ``_deepstack_process``
    on the whole row; gradients of the hidden states and the (TP-replicated) features whole on
    every rank. Exact: one addition per visual row either way."""
    for rank, res in enumerate(world2):
        r = res["sp_deepstack_forms"]
        assert "error" not in r, r
        assert r["names"] == ["layers.0", ""], r
        for case in ("mask", "positions", "positions_rank0"):
            assert r[case]["rows"] == [1, 19 - rank, 8], (case, r)
            for key in ("out", "g_hidden", "g_feats"):
                assert r[case][key] == 0.0, (rank, case, key, r)


def test_vocab_parallel_loss_equals_the_whole_logits(world2):
    """TP's LM head split over the vocabulary and its loss (never [T, vocab]) == torch's
    cross-entropy on the whole logits, values and gradients, within fp32 summation order."""
    for res in world2:
        r = res["vocab_parallel_ce"]
        assert "error" not in r, r
        assert r["n"] == r["ref_n"]
        assert abs(r["loss"] - r["ref"]) <= 1e-5 * abs(r["ref"]), r
        for key in ("g_hidden", "g_weight", "g_bias", "whole_logits"):
            assert r[key] < 1e-5, (key, r)


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


@pytest.mark.parametrize("name", ["ep2_vl_adamw", "ep2_moe_muon", "tp2_vl_muon"])
def test_two_ranks_checkpoint_resumes_at_degree_one(world2, name):
    _check_resume(world2, name)


@pytest.mark.parametrize("name", ["ep4_moe", "fsdp2_ep2_vl", "tp2_fsdp2_qwen3"])
def test_four_ranks_checkpoint_resumes_at_degree_one(world4, name):
    _check_resume(world4, name)


@pytest.mark.parametrize(
    ("name", "degrees"),
    [("ep4_moe", {"ep": 2, "tp": 1, "dp_shard": 2}),  # EP 4 -> 2 and FSDP 4 -> 2
     ("tp2_fsdp2_qwen3", {"ep": 1, "tp": 1, "dp_shard": 2})],  # TP 2 x FSDP 2 -> FSDP 2
)  # fmt: skip
def test_four_rank_checkpoint_resumes_on_two_ranks(world4, name, degrees):
    """The 4-rank layout's checkpoint, resumed by a new 2-rank group of the same spawn whose
    ranks take two former DP ranks' packs each: the straight run's step-3 loss (fp32 summation
    order of the other layout) and parameters."""
    for rank in (0, 1):
        assert "error" not in world4[rank][name], world4[rank][name]["error"]
        r = world4[rank][name]["regrouped"]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert {k: r[k] for k in degrees} == degrees
        for got, ref in zip(r["losses"], r["straight"], strict=True):
            assert abs(got - ref) <= 1e-5 * abs(ref), (name, r)
        assert r["param_err"] < 5e-3, (name, r)
    assert world4[0][name]["regrouped"]["losses"] == world4[1][name]["regrouped"]["losses"]


@pytest.mark.parametrize(("world", "name"), [(2, "tp2_vl_muon"), (4, "fsdp2_ep2_vl")])
def test_hf_export_of_a_parallel_run_loads_in_transformers(world2, world4, world, name):
    """The trainer's export (rank 0 writes) loads with transformers' Auto class: every weight
    is the run's own, bit for bit, and the logits equal exactly those of one process holding
    the same weights in the same class (TP 2 on Qwen3-VL; FSDP 2 x EP 2 on Qwen3-VL-MoE)."""
    r = (world2 if world == 2 else world4)[0][name]
    assert "error" not in r, r["error"]
    e = r["export"]
    assert e["same_keys"], e
    assert e["weights_err"] == 0.0 and e["logits_err"] == 0.0, e
