"""`muon_fused_step: true` (lmms_optim.MasterMuon over MasterWeights' fp32 masters) on CPU runs
Muon with the same clip multiply and copies as the three-pass step: the same losses, grad norms
and weights bit for bit, and either path resumes the other's checkpoint."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import tiny_config

import lmms_train._trainer as trainer
from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.config import config_from_dict

_TRAIN_LOOP = trainer.train_loop


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _run(tiny_inputs, out, monkeypatch, **trainer_args) -> tuple[list[float], dict]:
    """Losses and grad norms of a bf16 Muon run, its optimizer's class name and final weights."""
    seen: dict = {}

    def spy(run):
        result = _TRAIN_LOOP(run)
        seen["optimizer"] = type(run.optimizer).__name__
        seen["weights"] = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        return result

    monkeypatch.setattr(trainer, "train_loop", spy)
    cfg = tiny_config(
        tiny_inputs, out, max_steps=4, save_final=False, bf16=True, optimizer="muon",
        muon_learning_rate=0.02, gradient_accumulation_steps=2, max_grad_norm=0.05,
        **trainer_args,
    )  # fmt: skip
    train(config_from_dict(cfg))
    rows = read_jsonl(out / "metrics.jsonl")
    return [r[k] for r in rows for k in ("loss", "grad_norm")], seen


def test_muon_fused_step_equals_the_three_passes(tiny_inputs, tmp_path, monkeypatch, no_torchrun):
    runs = {}
    for fused in (False, True):
        out = tmp_path / f"fused_{fused}"
        runs[fused] = _run(tiny_inputs, out, monkeypatch, save_steps=2, muon_fused_step=fused)
    (losses, seen), (ref_losses, ref_seen) = runs[True], runs[False]
    assert seen["optimizer"] == "MasterMuon" and ref_seen["optimizer"] == "Muon"
    assert len(losses) == 8 and all(n > 0.05 for n in losses[1::2])  # clipped every step
    assert losses == ref_losses
    for name, w in ref_seen["weights"].items():
        assert w.dtype == torch.bfloat16 or not w.requires_grad, name
        assert torch.equal(seen["weights"][name], w), name
    for fused in (False, True):  # each path resumes the other's step-2 checkpoint
        ckpt = tmp_path / f"fused_{not fused}" / "checkpoints" / "step_000002"
        resumed, _ = _run(
            tiny_inputs, tmp_path / f"resumed_{fused}", monkeypatch,
            muon_fused_step=fused, resume_from=str(ckpt),
        )  # fmt: skip
        assert resumed == runs[not fused][0][4:]
