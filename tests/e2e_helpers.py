"""Helpers of the end-to-end trainer tests (configs, CLI subprocesses, free ports)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart" / "qwen2_5_vl_tiny.yaml"


def tiny_config(inputs: dict[str, str], out_dir: Path, **trainer: object) -> dict:
    """The quickstart config shrunk for tests, pointing at the session's inputs."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg["model_config"]["processor_path"] = inputs["processor"]
    d = cfg["dataset_config"]
    d.pop("generate_synthetic")
    d.update(dataset_path=inputs["data"], eval_dataset_path=inputs["data"], packing_length=384)
    t = cfg["trainer_args"]
    t.update(output_dir=str(out_dir), max_steps=4, eval_steps=0, save_steps=0, report_to=[])
    t.update(trainer)
    return cfg


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(
    args: list[str], *, nproc: int = 1, timeout: int = 300, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """`lmms-train ARGS` (or torchrun with `nproc` CPU ranks) in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "lmms_train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "-m", "lmms_train", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def expect_failure(main, argv: list[str], capsys, *needles: str, code: int = 2) -> str:
    """Run the CLI in-process; assert the exit code, no traceback, every message line starting
    with `lmms-train: error:`, and each needle in stderr. Returns stderr."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("lmms-train: error:")]
    assert lines and err.strip().splitlines()[-1].startswith("lmms-train: error:"), err
    for n in needles:
        assert n in err, f"{n!r} not in:\n{err}"
    return err


def tree_digest(root: Path) -> dict[str, str]:
    """`{relative path: sha256}` of every file under `root` (to show nothing was touched)."""
    root = Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lmms-train.lock"
    }
