"""Helpers of the end-to-end trainer tests: configs, the CLI in subprocesses (one run, or many
runs in one torchrun launch: `run_cli_batch`), and a run's logged steps (`step_rows`).

Run as a script under torchrun (``e2e_helpers.py RUNS.json DONE_DIR``) it is the worker side of
`run_cli_batch`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
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


def llada_config(inp: dict, out: Path, **trainer: object) -> dict:
    """Masked diffusion on the session's LLaDA-layout folder (conftest's `llada_inputs`)."""
    return {
        "model_config": {"load_from_pretrained_path": str(inp["folder"]),
                         "processor_path": str(inp["root"] / "proc"),
                         "objective": "masked_diffusion"},
        "dataset_config": {"dataset_path": str(inp["root"] / "data"), "packing_length": 256,
                           "num_workers": 0},
        "trainer_args": {"output_dir": str(out), "max_steps": 4, "report_to": [],
                         "learning_rate": 3e-3, "warmup_steps": 0, "save_final": False,
                         "eval_steps": 0, "save_steps": 0, **trainer},
    }  # fmt: skip


def bagel_args(tmp: Path, out: str, *extra: str) -> list[str]:
    """Overrides of examples/bagel/tiny_cpu.yaml: data and processor under `tmp`, output `tmp/out`."""
    return [f"dataset_config.dataset_path={tmp / 'data'}",
            "dataset_config.generate_synthetic.num_samples=64", "dataset_config.packing_length=256",
            f"model_config.processor_path={tmp / 'processor'}", f"trainer_args.output_dir={tmp / out}",
            "trainer_args.report_to=[]", "trainer_args.eval_steps=0", "trainer_args.ema_decay=0.9",
            "trainer_args.device=cpu", *extra]  # fmt: skip


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def step_rows(out: Path, *keys: str) -> list[dict]:
    """The steps a run logged (the rows of `out/metrics.jsonl` with a loss), only `keys` if
    given."""
    from lmms_train._metrics import read_jsonl

    rows = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "loss" in r]
    return [{k: r[k] for k in keys} for r in rows] if keys else rows


def losses(out: Path) -> list[float]:
    """A run's loss per logged step."""
    return [r["loss"] for r in step_rows(out)]


def _launch(
    target: list[str], nproc: int, timeout: float, cwd: Path
) -> subprocess.CompletedProcess:
    from lmms_parallel.testing import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nproc == 1 and target[0] == "-m":
        cmd = [sys.executable, *target]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *target]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


_SEQUENCE = (
    "import json, sys\n"
    "from lmms_train.cli import main\n"
    "print(json.dumps({n: main(a) for n, a in json.loads(sys.argv[1]).items()}))\n"
)


def run_cli_sequence(runs: dict[str, list[str]], *, timeout: float = 1800) -> dict[str, int]:
    """Every ``lmms-train ARGS`` of `runs` ({name: ARGS}) one after another in ONE fresh
    process (imports paid once, nothing inherited from the test process): {name: exit code}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-c", _SEQUENCE, json.dumps(runs)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(
            f"the reference runs' process exited {done.returncode}:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cli(
    args: list[str], *, nproc: int = 1, timeout: int = 300, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """`lmms-train ARGS` (or torchrun with `nproc` CPU ranks) in a fresh process."""
    return _launch(["-m", "lmms_train", *args], nproc, timeout, cwd)


_MARK = "[e2e batch] run "


def run_cli_batch(
    runs: dict[str, list[str]], *, nproc: int, timeout: float = 1800
) -> dict[str, str | None]:
    """Every ``lmms-train ARGS`` of `runs` ({name: ARGS}) in one torchrun launch of `nproc` CPU
    ranks: the same worker processes run them in order (each run joins and leaves its own
    process group), so torch, transformers and lmms are imported once for all of them.

    Returns ``{name: None}`` for a run that finished on every rank, else the launch's stderr from
    that run on. A failing run ends its launch (torchrun stops the other ranks); the runs after
    it go on in a new launch."""
    outcome: dict[str, str | None] = {}
    pending = list(runs)
    with tempfile.TemporaryDirectory(prefix="e2e_batch_") as tmp:
        while pending:
            spec = Path(tmp, f"runs{len(outcome)}.json")
            spec.write_text(json.dumps([[name, runs[name]] for name in pending]))
            try:
                err = _launch([__file__, str(spec), tmp], nproc, timeout, REPO).stderr
            except subprocess.TimeoutExpired as exc:
                tail = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr
                err = f"{exc}\n{tail or ''}"
            while pending and all(_done(tmp, pending[0], r).exists() for r in range(nproc)):
                outcome[pending.pop(0)] = None
            if pending:
                name = pending.pop(0)
                at = err.rfind(f"{_MARK}{name}:")
                outcome[name] = err[at:] if at >= 0 else err
    return outcome


def _done(folder: str, name: str, rank: int | str) -> Path:
    return Path(folder, f"{name.replace('/', '__')}.rank{rank}")


def _batch_worker(spec: str, done: str) -> int:
    """One rank of `run_cli_batch`: each run through the CLI's entry point, in order, each with
    a rendezvous of its own (as a fresh torchrun would give it): rank 0 serves a new store on a
    free port, named to the others through torchrun's store. Reusing torchrun's store, a run's
    gloo group would find the previous group's addresses under the same keys and hang."""
    from datetime import timedelta

    import torch.distributed as dist

    from lmms_parallel.testing import free_port
    from lmms_train.cli import main

    rank = os.environ["RANK"]
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=10))  # fmt: skip
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts each run's store
    for name, argv in json.loads(Path(spec).read_text()):
        if rank == "0":
            agent.set(f"e2e_batch/{name}", str(free_port()))
        os.environ["MASTER_PORT"] = agent.get(f"e2e_batch/{name}").decode()
        print(f"{_MARK}{name}: lmms-train {' '.join(argv)}", file=sys.stderr, flush=True)
        code = main(argv)
        if code:
            return code
        _done(done, name, rank).touch()
    return 0


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


if __name__ == "__main__":
    sys.exit(_batch_worker(*sys.argv[1:]))
