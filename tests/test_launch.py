"""`lmms-train launch` keeps lmms-train's exit codes under torchrun (docs/failures.md).

torchrun alone turns a worker's exit 2 or 75 into its own 1; the launcher exits with the
workers' code. Two gloo ranks on the CPU: a user error (2 on every rank) and a SIGTERM to the
launcher mid-run (both ranks save at the same step boundary: 75, then a resume finishes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import REPO, tiny_config, write_config

from lmms_train._launch import _split, launch_exit_code


def test_exit_code_precedence_and_argument_split():
    assert launch_exit_code(0, {0: 0, 1: 0}) == 0
    assert launch_exit_code(1, {0: 2, 1: 2}) == 2
    assert launch_exit_code(1, {0: 75, 1: 75}) == 75
    assert launch_exit_code(1, {0: 75}) == 75  # rank 1 killed by torchrun: no code
    assert launch_exit_code(1, {0: 130, 1: 75}) == 130
    assert launch_exit_code(1, {0: 2, 1: 75}) == 2
    assert launch_exit_code(1, {0: 1, 1: 2}) == 1  # a bug anywhere is a bug
    assert launch_exit_code(1, {0: 0, 1: -9}) == 1  # an unknown code too
    assert launch_exit_code(2, {}) == 2  # torchrun failed before any worker ran
    assert _split(["--nproc_per_node", "2", "run.yaml", "a.b=1"]) == (
        ["--nproc_per_node", "2"], ["run.yaml", "a.b=1"])  # fmt: skip
    assert _split(["--standalone", "--nproc_per_node=2", "x.yml"]) == (
        ["--standalone", "--nproc_per_node=2"], ["x.yml"])  # fmt: skip


def _launch(args: list[str]) -> subprocess.Popen:
    from lmms_parallel.testing import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lmms_train", "launch", "--nproc_per_node=2",
           f"--master_port={free_port()}", *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.multiprocess
def test_launch_keeps_2_and_75_under_torchrun(tiny_inputs, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_config(tiny_inputs, out, max_steps=200, logging_steps=1)
    cfg["dataset_config"]["eval_dataset_path"] = None
    path = write_config(cfg, tmp_path / "c.yaml")
    # a user error on every rank that needs no model code (a config's key errors come with the
    # preflight's checks, which import torch and every family: ~20 s more on 2 cores)
    bad = _launch([str(tmp_path / "missing.yaml")])
    _, err = bad.communicate(timeout=600)
    assert bad.returncode == 2, err
    assert "config file not found" in err and "exit 2" in err

    run = _launch([str(path)])
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1]
        time.sleep(0.5)
    run.send_signal(signal.SIGTERM)  # as a scheduler preempting the job
    _, err = run.communicate(timeout=600)
    assert run.returncode == 75, err
    assert "SIGTERM: saved step" in err and "exit 75" in err
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step_"), saved
    assert Path(out / "checkpoints" / saved[0]).is_dir()
