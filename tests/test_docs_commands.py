"""The docs cannot drift: every shell command of docs/*.md and of the example YAMLs' comments
(extracted by scripts/docs_commands.py, so new ones are picked up) is checked here in seconds.

* each training command: its config loads with the command's overrides and passes the run's
  preflight (CPU configs: data, processor and output checks; GPU / real-data configs: keys and
  values only, their files are not on this machine). Changed for the check, and said here: the
  run's `output_dir` is a fresh temporary folder, and `resume_from` is left out (it needs the
  earlier run: the script's real run checks it);
* each subcommand (render, sample, precompute, ...): its arguments are accepted: run where its
  inputs do not exist, the error must name the missing input, never the usage line.

Running them for real (the tiny trainings, then their render / sample, minutes) is the script's
job: `python scripts/docs_commands.py` (not in CI; docs/trainer.md, "Docs commands")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "docs_commands", REPO / "scripts" / "docs_commands.py"
)
dc = importlib.util.module_from_spec(_spec)
sys.modules["docs_commands"] = dc  # its dataclass looks its module up
_spec.loader.exec_module(dc)

COMMANDS = dc.extract(REPO)
KINDS = {"cpu", "gpu", "data", "network", "template", "suite"}
TRAIN = [c for c in COMMANDS if c.lmms_args and c.lmms_args[0].endswith(".yaml")
         and (REPO / c.lmms_args[0]).is_file()]  # fmt: skip
SUB = [c for c in COMMANDS if c.lmms_args and c.lmms_args[0] in dc.SUBCOMMANDS
       and c.kind == "cpu"]  # fmt: skip


def _id(c) -> str:
    return f"{c.file}:{c.line}"


def test_every_command_is_found_and_has_a_kind():
    assert len(COMMANDS) > 50 and {c.kind for c in COMMANDS} <= KINDS
    files = {c.file.split("/")[0] for c in COMMANDS}
    assert files == {"docs", "examples"}
    cpu_trainings = [c for c in TRAIN if c.kind == "cpu"]
    assert any("examples/sit/tiny_cpu.yaml" in c.text for c in cpu_trainings)
    assert len(SUB) >= 4  # renders and samples


@pytest.mark.parametrize("cmd", TRAIN, ids=_id)
def test_training_command_config_loads(cmd, tmp_path, monkeypatch):
    from lmms_train._preflight import config_problems
    from lmms_train.config import load_config

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", str(cmd.nproc))  # as torchrun --nproc_per_node sets it
    path, *overrides = cmd.lmms_args
    overrides = [o for o in overrides if not o.startswith("trainer_args.resume_from=")]
    overrides.append(f"trainer_args.output_dir={tmp_path / 'out'}")
    checks = config_problems if cmd.kind == "cpu" else None
    load_config(path, overrides, checks=checks)  # raises ConfigError naming every problem


@pytest.mark.parametrize("cmd", SUB, ids=_id)
def test_subcommand_arguments_are_accepted(cmd, tmp_path, monkeypatch, capsys):
    from lmms_train.cli import main

    (tmp_path / "examples").symlink_to(REPO / "examples")  # configs found; outputs are not
    monkeypatch.chdir(tmp_path)
    code = main(cmd.lmms_args)
    err = capsys.readouterr().err
    assert "usage:" not in err and "Traceback" not in err, err
    assert code in (0, 2), err
