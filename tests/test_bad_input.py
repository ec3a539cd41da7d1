"""Bad input ends with one clear message and a non-zero exit, never a traceback wall."""

from __future__ import annotations

import pytest
from e2e_helpers import run_cli, tiny_config, write_config

from lmms_train.cli import main


def _clean_failure(argv, capsys, *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("lmms-train: error:"), err
    for n in needles:
        assert n in err, err


@pytest.fixture()
def cfg_path(tiny_inputs, tmp_path):
    return str(write_config(tiny_config(tiny_inputs, tmp_path / "out"), tmp_path / "ok.yaml"))


def test_config_errors(cfg_path, tmp_path, capsys, monkeypatch):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("trainer_args: {max_steps: [1\n")
    _clean_failure([str(bad_yaml)], capsys, "malformed YAML")
    _clean_failure(
        [cfg_path, "trainer_args.lerning_rate=1"], capsys, "did you mean 'learning_rate'"
    )
    _clean_failure(
        [cfg_path, "model_config.load_from_config.model_type=qwen9_vl"],
        capsys, "not registered", "qwen2_5_vl", "registered:",
    )  # fmt: skip
    _clean_failure(
        [f"config_yaml={cfg_path}", "dataset_config.dataset_path=/nonexistent/data.parquet"],
        capsys, "dataset_config.dataset_path", "does not exist",
    )  # fmt: skip
    _clean_failure(["plot", str(tmp_path)], capsys, "no metrics.jsonl")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _clean_failure([cfg_path, "trainer_args.sp_ulysses_degree=3"], capsys, "not divisible")


def test_sample_longer_than_packing_length(cfg_path, capsys):
    # default policy (skip): every sample is too long, so the bad-record ratio aborts the run
    _clean_failure(
        [cfg_path, "dataset_config.packing_length=16"],
        capsys,
        "(too_long=",
        "raise dataset_config.packing_length",
    )
    # policy raise: stops at the first over-long sample, naming it, its length and where it is
    _clean_failure(
        [cfg_path, "dataset_config.packing_length=16", "dataset_config.bad_record_policy=raise"],
        capsys, "[too_long]", "tokens > packing_length 16", ".parquet record ",
        "raise dataset_config.packing_length",
    )  # fmt: skip


def test_cli_subprocess_exit_code(tmp_path):
    """The installed entry point exits 2 with one line (no traceback) on bad input."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config: [\n")
    proc = run_cli([str(bad)])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "malformed YAML" in proc.stderr


def test_out_of_memory_names_the_step_and_the_settings_to_change(
    tiny_inputs, tmp_path, capsys, monkeypatch
):
    """torch.OutOfMemoryError from the step (raised here at step 2: a CPU run cannot run out of
    device memory) ends with one message: the step, torch's first line, and this run's settings
    that trade memory for time with their values."""
    import torch

    import lmms_train._loop as loop

    calls = {"n": 0}
    real = loop.run_micro_batches

    def oom_on_second_step(**kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
        return real(**kw)

    monkeypatch.setattr(loop, "run_micro_batches", oom_on_second_step)
    cfg = tiny_config(
        tiny_inputs, tmp_path / "out", gradient_accumulation_steps=2,
        activation_checkpointing="full", activation_checkpointing_fraction=0.5,
    )  # fmt: skip
    assert main([str(write_config(cfg, tmp_path / "oom.yaml"))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    first = "lmms-train: error: out of device memory in step 2: CUDA out of memory. Tried"
    assert first in err, err
    for setting in (
        "activation_checkpointing_fraction: 0.5 -> higher",
        "gradient_accumulation_steps: 2",
        "packing_length: 384 -> lower",
        "LMMS_TRAIN_DEBUG=1",
    ):
        assert setting in err, err
