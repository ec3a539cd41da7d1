"""The built wheel installs alone into a fresh venv: numpy only, no torch; the README runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (PKG / "README.md").read_text(), flags=re.S)
    assert blocks, "README.md has no ```python example"
    return blocks[0]


def test_wheel_in_fresh_venv_has_no_torch_and_runs_readme(tmp_path):
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.skip("uv is not on PATH (the workspace's README installs it)")
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    rc, out = _run(
        [uv, "build", str(PKG), "--wheel", "--out-dir", str(tmp_path / "dist")], tmp_path, env
    )
    assert rc == 0, out
    (wheel,) = (tmp_path / "dist").glob("lmms_pack-*.whl")
    venv = tmp_path / "venv"
    rc, out = _run([uv, "venv", str(venv), "--python", sys.executable], tmp_path, env)
    assert rc == 0, out
    py = str(venv / "bin" / "python")
    rc, out = _run([uv, "pip", "install", "--python", py, str(wheel)], tmp_path, env)
    assert rc == 0, out

    check = (
        "import importlib.metadata as md, importlib.util as u, json, lmms_pack;"
        "print(json.dumps({'torch': u.find_spec('torch') is not None, 'file': lmms_pack.__file__,"
        "'dists': sorted(d.metadata['Name'].lower() for d in md.distributions())}))"
    )
    rc, out = _run([py, "-c", check], tmp_path, env)
    assert rc == 0, out
    info = json.loads(out)
    assert info["torch"] is False  # torch is not installed
    assert info["file"].startswith(str(venv))  # the wheel, not the workspace source
    assert set(info["dists"]) == {"lmms-pack", "numpy"}, info["dists"]  # numpy only

    rc, out = _run([py, "-c", "import lmms_pack.torch"], tmp_path, env)
    assert rc != 0 and "lmms-pack[torch]" in out, out  # names the extra

    (tmp_path / "example.py").write_text(readme_example())
    rc, out = _run([py, "example.py"], tmp_path, env)
    assert rc == 0, out
