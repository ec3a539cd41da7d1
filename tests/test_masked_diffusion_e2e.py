"""Masked diffusion through lmms-train (the quickstart's Qwen2.5-VL decoder, packs with images):
FSDP2 on 2 ranks and Ulysses SP 2 equal the 1-process run (losses and masked-token metrics), and
SIGTERM + resume reproduces every step's loss and metrics bit for bit (the masks are redrawn from
(seed, step, sample), nothing random is carried in the checkpoint)."""

from __future__ import annotations

import os
import signal

import pytest
from e2e_helpers import run_cli, tiny_config, write_config

from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.config import config_from_dict

KEYS = ("loss", "md/masked_loss", "md/masked_acc", "md/mask_ratio")


def _md(cfg: dict) -> dict:
    cfg["model_config"]["objective"] = "masked_diffusion"
    cfg["model_config"]["objective_args"] = {"mask_token_id": 7, "eps": 0.05}  # <|audio_pad|>
    return cfg


def _rows(out):
    return [{k: r[k] for k in KEYS} for r in read_jsonl(out / "metrics.jsonl")]


@pytest.mark.multiprocess
def test_fsdp_and_sp_match_single_process(tiny_inputs, tmp_path):
    ref = _md(tiny_config(tiny_inputs, tmp_path / "ref", max_steps=3,
                          gradient_accumulation_steps=2, save_final=False))  # fmt: skip
    ref["dataset_config"]["num_workers"] = 2
    cfg = write_config(ref, tmp_path / "ref.yaml")
    proc = run_cli([str(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _rows(tmp_path / "ref")
    assert len(expected) == 3 and all(r["md/mask_ratio"] > 0 for r in expected)
    runs = {
        "fsdp": ["trainer_args.gradient_accumulation_steps=1", "dataset_config.num_workers=0"],
        "sp": ["trainer_args.sp_ulysses_degree=2"],
    }
    for name, extra in runs.items():
        p = run_cli([str(cfg), f"trainer_args.output_dir={tmp_path / name}", *extra], nproc=2)
        assert p.returncode == 0, p.stderr[-3000:]
        got = _rows(tmp_path / name)
        for r, e in zip(got, expected, strict=True):
            for k in KEYS:
                assert r[k] == pytest.approx(e[k], rel=2e-5, abs=1e-6), (name, k)


def test_sigterm_then_resume_redraws_the_same_masks(tiny_inputs, tmp_path, monkeypatch):
    steps = 4
    ref = _md(tiny_config(tiny_inputs, tmp_path / "ref", max_steps=steps, save_final=False))
    train(config_from_dict(ref))
    expected = _rows(tmp_path / "ref")

    import lmms_train._metrics as metrics

    original = metrics.JsonlSink.log

    def log_and_kill(self, step, m):
        original(self, step, m)
        if step == 1:  # seen when step 3 starts: step 3 is saved and the run stops
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(metrics.JsonlSink, "log", log_and_kill)
    run = _md(tiny_config(tiny_inputs, tmp_path / "run", max_steps=steps, save_final=False))
    train(config_from_dict(run))
    monkeypatch.setattr(metrics.JsonlSink, "log", original)
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) < steps
    run["trainer_args"]["resume_from"] = "latest"
    train(config_from_dict(run))
    assert _rows(tmp_path / "run") == expected  # bitwise on CPU
