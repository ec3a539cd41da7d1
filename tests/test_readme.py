"""The README's main command, run from a clean copy of the repository (tracked files only).

The copy has no generated inputs (`runs/.quickstart/`), so this checks that the quickstart is
self-contained: it must generate its dataset and processor, train with a visible loss drop
(final loss <= half the first), checkpoint and plot. The command runs with `uv run --no-sync`
on this checkout's environment (`UV_PROJECT_ENVIRONMENT`), so the test never rebuilds or
modifies the shared virtual environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from lmms_train._metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]


def _readme_commands() -> tuple[str, str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Two commands\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md must start with the '## Two commands' bash block"
    cmds = [
        ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")
    ]
    assert len(cmds) == 2, cmds
    return cmds[0], cmds[1]


def test_readme_test_command_is_what_ci_runs():
    _, tests = _readme_commands()
    assert tests == "uv run --all-packages --all-extras pytest"
    assert tests in (REPO / ".ci" / "run").read_text()


def test_the_whole_suite_runs_on_two_workers_and_a_path_in_one_process(monkeypatch):
    """The README's test command runs on the root conftest's workers (`-n auto`); paths or ids
    given to pytest, or a 1-core machine, run in one process."""
    import importlib.util
    import tomllib
    from types import SimpleNamespace

    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert {"-n", "auto", "--dist", "loadfile"} <= set(ini["addopts"].split())
    spec = importlib.util.spec_from_file_location("root_conftest", REPO / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    sources = pytest.Config.ArgsSource
    for cores, source, want in [(2, sources.TESTPATHS, 2), (64, sources.TESTPATHS, 2),
                                (1, sources.TESTPATHS, 0), (2, sources.ARGS, 0),
                                (2, sources.INVOCATION_DIR, 0)]:  # fmt: skip
        monkeypatch.setattr(
            os, "sched_getaffinity", lambda _, n=cores: set(range(n)), raising=False
        )
        got = root.pytest_xdist_auto_num_workers(SimpleNamespace(args_source=source))
        assert got == want, (cores, source, got)


def _clean_copy(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


@pytest.mark.slow
def test_readme_main_command_from_clean_checkout(tmp_path):
    main_cmd, _ = _readme_commands()
    if shutil.which("uv") is None:
        pytest.skip("uv is not installed")
    clone = tmp_path / "clone"
    _clean_copy(clone)
    example = clone / "examples" / "quickstart" / "qwen2_5_vl_tiny.yaml"
    assert example.is_file(), "the quickstart config must be tracked by git"
    argv = shlex.split(main_cmd)
    assert argv[:2] == ["uv", "run"]
    argv = ["uv", "run", "--no-sync", *argv[2:]]
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(REPO / ".venv"), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = clone / "runs" / "quickstart"
    records = read_jsonl(run / "metrics.jsonl")
    assert len(records) == 24
    assert records[-1]["loss"] <= 0.5 * records[0]["loss"], (
        records[0]["loss"],
        records[-1]["loss"],
    )
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"):
        assert key in records[-1]
    assert "eval_loss" in records[-1]
    assert (run / "checkpoints" / "step_000024" / "COMPLETE").is_file()
    assert (run / "metrics.png").stat().st_size > 1000
    assert (run / "config.yaml").is_file()
