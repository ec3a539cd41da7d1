"""The docs cannot drift: every shell command of docs/*.md and of the example YAMLs' comments
(extracted by scripts/docs_commands.py, so new ones are picked up) is checked here in seconds.

* each fast command (`--help`, `--version`, `docs`, `plan`, `convert-config`, `check-data` of a
  `cpu` config: `DocCommand.fast`) is run as written, in this process, in a scratch copy of
  docs/ and examples/: exit 0 and the output each subcommand prints (`docs > FILE` writes the
  committed page); `lmms-train COMMAND --help` of every subcommand of the CLI too;
* each training command: its config loads with the command's overrides and passes the run's
  preflight (CPU configs: data, processor and output checks; GPU / real-data configs: keys and
  values only, their files are not on this machine). Changed for the check, and said here: the
  run's `output_dir` is a fresh temporary folder, and `resume_from` is left out (it needs the
  earlier run: the script's real run checks it);
* each other subcommand (render, sample, plot, ...): its arguments are accepted: run where its
  inputs do not exist, the error must name the missing input, never the usage line.

Running them for real (the tiny trainings, then their render / sample, minutes) is the script's
job: `python scripts/docs_commands.py` (not in CI; docs/trainer.md, "Docs commands")."""

from __future__ import annotations

import importlib.util
import shutil
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
KINDS = {"cpu", "gpu", "data", "network", "template", "suite", "script"}
TRAIN = [c for c in COMMANDS if c.lmms_args and c.lmms_args[0].endswith(".yaml")
         and (REPO / c.lmms_args[0]).is_file()]  # fmt: skip
SUB = [c for c in COMMANDS if c.lmms_args and c.lmms_args[0] in dc.SUBCOMMANDS
       and c.kind == "cpu" and not c.fast]  # fmt: skip
FAST = [c for c in COMMANDS if c.fast]
# what each fast command prints when it works (beside exit 0)
SANE = {"--help": "lmms-train", "-h": "lmms-train", "--version": "lmms-train", "docs": "# ",
        "plan": "needed per GPU", "check-data": "records", "convert-config": "model_config:"}  # fmt: skip


def _id(c) -> str:
    return f"{c.file}:{c.line}"


def test_every_command_is_found_and_has_a_kind():
    assert len(COMMANDS) > 50 and {c.kind for c in COMMANDS} <= KINDS
    files = {c.file.split("/")[0] for c in COMMANDS}
    assert files == {"docs", "examples"}
    cpu_trainings = [c for c in TRAIN if c.kind == "cpu"]
    assert any("examples/sit/tiny_cpu.yaml" in c.text for c in cpu_trainings)
    assert len(SUB) >= 4  # renders and samples
    fast = {c.lmms_args[0] for c in FAST}
    assert {"--help", "plan", "check-data", "docs"} <= fast, fast


def test_every_subcommand_is_known_and_has_help(capsys):
    """The script's table of subcommands is the CLI's (a new one is classified), and
    `lmms-train COMMAND --help` prints its usage for each (exit 0)."""
    from lmms_train.cli import _subcommand_names, main

    names = [n for n in _subcommand_names() if not n.startswith("-")]  # --version is a flag
    assert set(dc.SUBCOMMANDS) == set(names)
    for name in names:
        assert main([name, "--help"]) == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: lmms-train {name}"), (name, out)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """docs/ and examples/ copied: what the fast commands write (generated data, processors,
    `docs > docs/config.md`) lands here, never in the checkout."""
    root = tmp_path_factory.mktemp("docs_commands")
    for folder in ("docs", "examples"):
        shutil.copytree(REPO / folder, root / folder)
    return root


@pytest.mark.parametrize("cmd", FAST, ids=_id)
def test_fast_command_runs_as_written(cmd, scratch, monkeypatch, capsys):
    from lmms_train.cli import main

    monkeypatch.chdir(scratch)
    args, target = cmd.lmms_args, None
    if ">" in args:  # `lmms-train docs > docs/config.md`: stdout into the file
        args, target = args[: args.index(">")], args[args.index(">") + 1]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert SANE["--help" if "--help" in args else args[0]] in out, out[-3000:]
    if target is not None:
        (scratch / target).write_text(out)
        assert out == (REPO / target).read_text(), f"{target} is not what `{cmd.text}` writes"


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
