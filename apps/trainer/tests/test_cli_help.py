"""CLI edges (issue 34, 6): `lmms-train SUB --help` for every subcommand, and config-key errors
shown before torch, transformers or the model code are imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import yaml

from lmms_train.cli import _subcommand_names, main

HEAVY = ("torch", "transformers", "lmms_models", "lmms_kernels", "lmms_parallel")


@pytest.mark.parametrize("name", _subcommand_names())
def test_every_subcommand_has_help(name, capsys):
    for flag in ("--help", "-h"):
        assert main([name, flag]) == 0
        out = capsys.readouterr()
        assert out.err == "" and f"lmms-train {name}" in out.out, out
        assert "error" not in out.out


def test_config_key_errors_come_before_heavy_imports(tmp_path):
    """A typo'd key is shown by the real CLI path before its checks run, and nothing on the way
    there imports torch, transformers or the model code (those come with the checks)."""
    cfg = {"model_config": {"load_from_config": {"model_type": "qwen2", "tiny": True}},
           "dataset_config": {"dataset_path": str(tmp_path / "data")},
           "trainer_args": {"output_dir": str(tmp_path / "out"), "max_stepz": 3}}  # fmt: skip
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = textwrap.dedent(f"""
        import sys
        import lmms_train.cli as cli

        def checks(cfg):  # stands in for the preflight (which imports torch)
            print("checks: heavy", sorted(m for m in {HEAVY!r} if m in sys.modules),
                  file=sys.stderr, flush=True)
            return []

        cli._config_problems = checks
        rc = cli.main([{str(path)!r}])
        print("rc", rc, file=sys.stderr)
        for sub in (["check-data"], ["precompute", "--out", "x"]):  # commands reading a config
            rc = cli.main([sub[0], {str(path)!r}, *sub[1:]])
            print(sub[0], rc, sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == (
        "lmms-train: error: unknown key 'trainer_args.max_stepz' (did you mean 'max_steps'?)"
    ), proc.stderr
    assert lines[1:3] == ["checks: heavy []", "rc 2"], proc.stderr
    assert lines[3:] == [lines[0], "check-data 2 []", lines[0], "precompute 2 []"], proc.stderr
