"""Masked diffusion through lmms-train (the quickstart's Qwen2.5-VL decoder, packs with images):
SIGTERM + resume reproduces every step's loss and metrics bit for bit (the masks are redrawn from
(seed, step, sample), nothing random is carried in the checkpoint). FSDP2 on 2 ranks and Ulysses
SP 2 == 1 process: tests/test_cli_layouts.py."""

from __future__ import annotations

from e2e_helpers import step_rows, tiny_config

from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.config import config_from_dict

KEYS = ("loss", "md/masked_loss", "md/masked_acc", "md/mask_ratio")


def _md(cfg: dict) -> dict:
    cfg["model_config"]["objective"] = "masked_diffusion"
    cfg["model_config"]["objective_args"] = {"mask_token_id": 7, "eps": 0.05}  # <|audio_pad|>
    return cfg


def test_sigterm_then_resume_redraws_the_same_masks(tiny_inputs, tmp_path, sigterm_after_logging):
    steps = 4
    ref = _md(tiny_config(tiny_inputs, tmp_path / "ref", max_steps=steps, save_final=False))
    train(config_from_dict(ref))
    expected = step_rows(tmp_path / "ref", *KEYS)

    sigterm_after_logging(1)  # the run saves and stops before the last step
    run = _md(tiny_config(tiny_inputs, tmp_path / "run", max_steps=steps, save_final=False))
    train(config_from_dict(run))
    sigterm_after_logging(None)
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) < steps
    run["trainer_args"]["resume_from"] = "latest"
    train(config_from_dict(run))
    assert step_rows(tmp_path / "run", *KEYS) == expected  # bitwise on CPU
