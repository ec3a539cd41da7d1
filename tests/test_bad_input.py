"""Bad input ends with one clear message and a non-zero exit, never a traceback wall.

The corpus (docs/failures.md): config problems (all of one file in one report, registry names,
GPU-only switches on the CPU, a file that is not UTF-8), output folders that cannot be written,
data files that are empty, truncated or corrupt; each through the real CLI, in-process, asserting
the exit code, the line and that nothing already written changed. Checkpoint, divergence and
lock failures: tests/test_failures.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from e2e_helpers import expect_failure, run_cli, tiny_config, tree_digest, write_config

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
    _clean_failure(  # synthetic kinds are lmms-data's registry (a family registers its own)
        [cfg_path, "dataset_config.generate_synthetic.kind=shape"], capsys,
        "generate_synthetic.kind: 'shape' is not registered (did you mean 'shapes'?)", "bagel",
    )  # fmt: skip
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


def test_every_config_problem_in_one_report(cfg_path, capsys):
    err = expect_failure(
        main,
        [
            cfg_path, "trainer_args.learning_rate=-1", "trainer_args.warmup_ratio=2",
            "trainer_args.lerning_rate=1", "trainer_args.max_steps=many",
            "dataset_config.dataset_type=chatt", "dataset_config.packing_strategy=first_fitt",
            "trainer_args.attn_backend=fa5", "dataset_config.dataset_format=csv",
        ],
        capsys, "8 problems in the configuration",
        "learning_rate must be a finite number > 0, got -1.0", "warmup_ratio must be in [0, 1)",
        "did you mean 'learning_rate'", "max_steps: expected an integer, got 'many'",
        "dataset_type: 'chatt' is not registered (did you mean 'chat'?)",
        "packing_strategy: 'first_fitt' is not registered (did you mean 'first_fit'?)",
        "attn_backend: 'fa5' is not registered", "dataset_format",
    )  # fmt: skip
    assert len([ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]) == 9, err


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks switches that need a GPU on the CPU"
)
def test_gpu_only_switches_on_a_cpu_run(cfg_path, capsys):
    expect_failure(
        main,
        [cfg_path, "trainer_args.attn_backend=fa4", "trainer_args.loss_backend=liger",
         "trainer_args.use_liger_kernel=true", "trainer_args.device=cuda"],
        capsys, "4 problems", "'fa4' needs a CUDA GPU; this run is on the CPU",
        "loss_backend: 'liger' needs a CUDA GPU", "use_liger_kernel needs a CUDA GPU",
        "device: cuda, but no CUDA GPU",
    )  # fmt: skip


def test_config_not_utf8_and_debug_flag(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("trainer_args:\n  run_name: caf\u00e9\n".encode("latin-1"))
    expect_failure(main, [str(bad)], capsys, "is not UTF-8 text (byte 0xe9 on line 2)")
    from lmms_train._errors import ConfigError

    with pytest.raises(ConfigError, match="not UTF-8"):  # --debug: the traceback, not a line
        main([str(bad), "--debug"])


def test_output_dir_that_cannot_be_written(tiny_inputs, tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder\n")
    for out, needle in (
        (a_file, "is a file, not a folder"),
        (a_file / "run", f"cannot be created: {str(a_file)!r} is a file"),
    ):
        cfg = write_config(tiny_config(tiny_inputs, out), tmp_path / "c.yaml")
        expect_failure(main, [str(cfg)], capsys, "trainer_args.output_dir", needle)
    assert a_file.read_text() == "not a folder\n"
    if os.geteuid() != 0:  # root writes into read-only folders: tests/test_failures.py mounts one
        ro = tmp_path / "ro"
        (ro / "checkpoints").mkdir(parents=True)
        for target, needle in ((ro, "is not writable"), (ro / "checkpoints", "checkpoints folder")):
            target.chmod(0o555)
            cfg = write_config(tiny_config(tiny_inputs, ro), tmp_path / "c.yaml")
            expect_failure(main, [str(cfg)], capsys, needle)
            target.chmod(0o755)


def _corrupt_corpus(tiny_inputs, root: Path) -> Path:
    """The session's Parquet shard, a truncated copy and an Arrow file of random bytes."""
    shard = sorted(Path(tiny_inputs["data"]).glob("*.parquet"))[0]
    root.mkdir()
    shutil.copy(shard, root / "b_good.parquet")
    data = shard.read_bytes()
    (root / "c_truncated.parquet").write_bytes(data[: len(data) // 2])
    (root / "a_garbage.arrow").write_bytes(os.urandom(2048))
    return root


def test_corrupt_and_empty_data_files(tiny_inputs, tmp_path, capsys, caplog, monkeypatch):
    import lmms_train._trainer as trainer

    data = _corrupt_corpus(tiny_inputs, tmp_path / "data")
    cfg = tiny_config(tiny_inputs, tmp_path / "out", max_steps=2)
    cfg["dataset_config"].update(dataset_path=str(data), eval_dataset_path=None, shuffle=False)
    path = write_config(cfg, tmp_path / "c.yaml")
    real_build = trainer.build_model
    monkeypatch.setattr(trainer, "build_model", lambda *a: pytest.fail("model built"))
    # raise: stops before the model is built, naming the file
    expect_failure(
        main, [str(path), "dataset_config.bad_record_policy=raise"], capsys,
        "[corrupt_file] unreadable file:", "a_garbage.arrow", "bad_record_policy",
    )  # fmt: skip
    # an empty file, or a folder of empty files: named before the model is built
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.parquet").write_bytes(b"")
    expect_failure(
        main, [str(path), f"dataset_config.dataset_path={tmp_path / 'empty' / 'x.parquet'}"],
        capsys, "x.parquet' is an empty file (0 bytes)",
    )  # fmt: skip
    expect_failure(
        main, [str(path), f"dataset_config.dataset_path={tmp_path / 'empty'}"], capsys,
        "holds no records (1 of 1 file(s) are empty",
    )  # fmt: skip
    assert not (tmp_path / "out" / "config.yaml").exists()  # a run that never started wrote none
    # skip (default): both unreadable files are named, counted and the run trains on the rest
    monkeypatch.setattr(trainer, "build_model", real_build)
    assert main([str(path)]) == 0
    log = caplog.text  # lmms_data's logger (stderr outside pytest)
    assert "skipping unreadable file" in log and "c_truncated.parquet" in log, log
    from lmms_train._metrics import read_jsonl

    assert read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]["bad_records"] >= 1


def test_bad_record_raised_in_a_worker_process_is_one_line(cfg_path, capsys):
    expect_failure(
        main,
        [cfg_path, "dataset_config.packing_length=16", "dataset_config.bad_record_policy=raise",
         "dataset_config.num_workers=1"],
        capsys, "[too_long]", "tokens > packing_length 16",
    )  # fmt: skip


def test_nothing_written_is_touched_by_a_failed_start(finished_run, capsys):
    out, path, before = finished_run
    for args, needle in (
        (["trainer_args.resume_from=nope"], "resume_from: 'nope' does not exist"),
        (["trainer_args.learning_rate=nan"], "learning_rate must be a finite number"),
        (["dataset_config.dataset_type=nope"], "'nope' is not registered"),
    ):
        expect_failure(main, [str(path), *args], capsys, needle)
    assert tree_digest(out) == before


def test_exit_codes_of_the_cli(cfg_path, capsys, monkeypatch):
    """0 finished, 75 stopped by SIGTERM after saving, 130 Ctrl-C, 2 for an OSError the machine
    caused (disk full, no permission), and a bug's exception propagates (exit 1, traceback)."""
    import errno

    import lmms_train._trainer as trainer
    from lmms_train._trainer import TrainOutcome

    def returning(stopped):
        return lambda cfg: TrainOutcome(metrics={}, stopped=stopped)

    def raising(exc):
        def run(cfg):
            raise exc

        return run

    monkeypatch.setattr(trainer, "run_training", returning(False))
    assert main([cfg_path]) == 0
    monkeypatch.setattr(trainer, "run_training", returning(True))
    assert main([cfg_path]) == 75
    monkeypatch.setattr(trainer, "run_training", raising(KeyboardInterrupt()))
    expect_failure(main, [cfg_path], capsys, "interrupted (Ctrl-C)", code=130)
    full = OSError(errno.ENOSPC, "No space left on device", "/x/metrics.jsonl")
    monkeypatch.setattr(trainer, "run_training", raising(full))
    expect_failure(main, [cfg_path], capsys, "no space left on the device while writing /x/")
    monkeypatch.setattr(trainer, "run_training", raising(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        main([cfg_path])
