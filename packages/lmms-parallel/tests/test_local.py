"""Single-process tests: mesh validation, activation checkpointing, meta init, checkpoints, export."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import _tiny as T

import lmms_parallel as lp


def test_parallel_dims_resolve_and_errors():
    assert lp.ParallelDims(dp_replicate=2, sp=2).resolve(8).dp_shard == 2
    assert lp.ParallelDims(dp_replicate=2, sp=2).resolve(8).dp_size == 4
    with pytest.raises(ValueError, match=r"2 \* 2 \* 3 \* 1 = 12 != world size 8"):
        lp.ParallelDims(dp_replicate=2, dp_shard=2, sp=3).resolve(8)
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        lp.ParallelDims(sp=3).resolve(8)
    with pytest.raises(ValueError, match="ep = 4 must divide"):
        lp.ParallelDims(dp_shard=2, ep=4).resolve(2)
    with pytest.raises(ValueError, match="resolve"):
        _ = lp.ParallelDims().dp_size


def test_sp_helpers_single_rank_are_identity():
    labels = torch.arange(7)
    assert lp.sp_shard_labels(labels, None) is labels
    assert lp.sp_pad_len(7, 4) == 8 and lp.sp_pad_len(8, 4) == 8
    s, n = lp.sp_reduce_loss(torch.tensor(3.0), 5, None)
    assert float(s) == 3.0 and int(n) == 5
    out = lp.UlyssesAttention(None)(
        torch.ones(3, 2, 4), torch.ones(3, 1, 4), torch.ones(3, 1, 4),
        torch.tensor([0, 3]), torch.tensor([0, 3]), 3, 3, causal=True, inner=T.sdpa_varlen,
    )  # fmt: skip
    assert out.shape == (3, 2, 4)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_same_gradients_and_reversible(mode):
    T.register_attention()
    row = T.make_row("qwen3", 3)
    grads = []
    for ac in ("none", mode):
        model = T.build("qwen3")
        keys = list(model.state_dict())
        handle = lp.apply_activation_checkpointing(T.blocks(model, "qwen3")[0], ac)
        s, n = T.row_loss(model, row)
        (s / n).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert list(model.state_dict()) == keys
        handle.remove()
        assert all("forward" not in b.__dict__ for b in model.model.layers)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must be one of"):
        lp.apply_activation_checkpointing([], "some")


def test_ac_fraction_selects_blocks_spread_evenly():
    def wrapped(n, fraction):
        blocks = [torch.nn.Identity() for _ in range(n)]
        handle = lp.apply_activation_checkpointing(blocks, "full", fraction=fraction)
        assert all(("forward" in b.__dict__) == (b in handle.blocks) for b in blocks)
        return [blocks.index(b) for b in handle.blocks]

    blocks = list(range(8))
    assert wrapped(8, 0.5) == [1, 3, 5, 7]  # every other block
    assert wrapped(8, 0.25) == [3, 7]
    assert wrapped(8, 1.0) == blocks and wrapped(8, 0.0) == []
    assert len(wrapped(36, 0.5)) == 18
    with pytest.raises(ValueError, match="fraction must be in"):
        lp.apply_activation_checkpointing([], "full", fraction=1.5)


def test_meta_init_materialize_restores_and_recomputes_buffers():
    ref = T.build("vl")
    with lp.meta_init():
        kept = T.build("vl")
    assert all(p.is_meta for p in kept.parameters())
    with torch.device("meta"):
        recomputed = T.build("vl")
    for model in (kept, recomputed):
        lp.materialize(model, "cpu")
        lp.load_full_state_dict(model, ref.state_dict())
        for name, buf in ref.named_buffers():
            torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0)
        ids = torch.randint(0, 100, (1, 9))
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    with torch.device("meta"):
        odd = Odd()
    with pytest.raises(RuntimeError, match="'table'"):
        lp.materialize(odd, "cpu")
    with torch.device("meta"):
        odd = Odd()
    lp.materialize(odd, "cpu", buffer_init=lambda m, name, dev: torch.arange(3.0, device=dev))
    assert odd.table.tolist() == [0.0, 1.0, 2.0]


def test_checkpointer_atomic_keep_last_and_resume(tmp_path):
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = lp.Checkpointer(tmp_path, keep_last=2)
    assert ckpt.latest() is None
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        ckpt.save(
            step,
            model=model,
            optimizer=opt,
            extra_state={"step": step, "rng": torch.get_rng_state()},
        )
    assert ckpt.steps() == [2, 3]
    assert ckpt.latest().name == "step_000003"
    (tmp_path / "step_000004.tmp").mkdir()  # a crash mid-save
    assert ckpt.latest().name == "step_000003"
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = opt.state[model.weight]["exp_avg"].clone()
    fresh = nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    extra = ckpt.load(model=fresh, optimizer=fresh_opt)
    assert extra["step"] == 3 and extra["rng"].dtype == torch.uint8
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)
    torch.testing.assert_close(fresh_opt.state[fresh.weight]["exp_avg"], exp_avg, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load(tmp_path / "step_000004.tmp", model=fresh)


def test_checkpointer_run_id_keeps_runs_apart(tmp_path):
    """Two runs' checkpoints in one folder: each run's pruning and `latest()` see only its own
    (the other run's newer steps are neither resumed nor counted against keep_last)."""
    model = nn.Linear(4, 3)
    old = lp.Checkpointer(tmp_path, keep_last=2, run_id="old")
    for step in (10, 20):
        old.save(step, model=model)
    new = lp.Checkpointer(tmp_path, keep_last=2, run_id="new")
    assert new.latest() is None
    for step in (1, 2, 3):
        new.save(step, model=model)
    assert new.steps() == [2, 3] and new.latest().name == "step_000003"
    assert old.steps() == [10, 20] and old.latest().name == "step_000020"
    assert lp.Checkpointer.run_of(new.latest()) == "new"
    assert lp.Checkpointer(tmp_path).steps() == [2, 3, 10, 20]  # no run_id: every run's


def test_export_hf_single_process(tmp_path):
    from transformers import AutoModelForCausalLM

    model = T.build("qwen3")
    lp.export_hf(model, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    lp.export_hf(plain, tmp_path / "plain")
    sd = lp.read_safetensors(tmp_path / "plain")
    assert set(sd) == set(plain.state_dict())


def test_ensure_vision_participation():
    tower = nn.Linear(4, 2)
    assert (
        lp.ensure_vision_participation(tower, lambda: {"input": torch.ones(1, 4)}, has_media=True)
        is None
    )
    assert lp.ensure_vision_participation(None, dict, has_media=False) is None
    extra = lp.ensure_vision_participation(
        tower, lambda: {"input": torch.ones(1, 4)}, has_media=False
    )
    assert float(extra) == 0.0
    extra.backward()
    assert tower.weight.grad is not None and float(tower.weight.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("kind", ["vl", "vl3"])
def test_dummy_vision_reaches_every_parameter_an_image_reaches(kind):
    """FSDP2 reduce-scatters the parameters that have a gradient: the sets must match.

    The merger (and Qwen3-VL's deepstack mergers) are outside the first output of the tower.
    """
    T.register_attention()
    model = T.build(kind)
    tower = model.model.visual
    T.row_loss(model, T.make_row(kind, 6))[0].backward()
    real = {n for n, p in tower.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    dummy = {"hidden_states": torch.zeros(4, 24), "grid_thw": torch.tensor([[1, 2, 2]])}
    zero = lp.ensure_vision_participation(tower, lambda: dummy, has_media=False)
    zero.backward()
    got = {n for n, p in tower.named_parameters() if p.grad is not None}
    assert got == real == {n for n, _ in tower.named_parameters()}
    assert all(float(p.grad.abs().sum()) == 0.0 for p in tower.parameters())


def test_vision_participation_runs_tower_only_without_media():
    T.register_attention()
    model = T.build("vl")
    calls = []
    model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    text_row, image_row = T.make_row("vl", 5, images=False), T.make_row("vl", 6)
    before = [float(T.row_loss(model, r)[0].detach()) for r in (text_row, image_row)]
    calls.clear()
    vp = lp.VisionParticipation(model.model.language_model, model.model.visual, lambda: {
        "hidden_states": torch.zeros(4, 24), "grid_thw": torch.tensor([[1, 2, 2]])}).install()  # fmt: skip
    s, _ = T.row_loss(model, text_row)
    assert len(calls) == 1  # the dummy
    s.backward()
    assert float(model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum()) == 0.0
    s2, _ = T.row_loss(model, image_row)
    assert len(calls) == 2  # the real images only, no dummy
    assert [float(s.detach()), float(s2.detach())] == before
    vp.remove()
