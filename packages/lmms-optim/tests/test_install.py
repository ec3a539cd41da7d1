"""lmms-optim installs alone (wheel into a fresh venv) with only its declared dependencies."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def fresh_env(tmp_path_factory):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    tmp = tmp_path_factory.mktemp("lmms_optim_env")
    run = lambda *a: subprocess.run(a, cwd=ROOT, capture_output=True, text=True, timeout=900)  # noqa: E731
    r = run(uv, "build", "--wheel", "--package", "lmms-optim", "-o", str(tmp / "dist"))
    assert r.returncode == 0, r.stderr
    wheel = next((tmp / "dist").glob("lmms_optim-*.whl"))
    r = run(uv, "venv", "--python", "3.11", str(tmp / "venv"))
    assert r.returncode == 0, r.stderr
    py = tmp / "venv" / "bin" / "python"
    r = run(uv, "pip", "install", "--python", str(py), "--link-mode", "hardlink", str(wheel))
    assert r.returncode == 0, r.stderr
    return py, run, uv


@pytest.mark.slow
def test_installs_alone_and_imports(fresh_env):
    py, run, uv = fresh_env
    r = run(str(py), "-c", "import lmms_optim, torch; print(lmms_optim.__all__);"
            "m = torch.nn.Linear(4, 4); o = lmms_optim.Muon(m.parameters());"
            "m(torch.randn(2, 4)).sum().backward(); o.step(); print('ok')")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr
    r = run(uv, "pip", "list", "--python", str(py), "--format", "freeze")
    names = {line.split("==")[0].lower() for line in r.stdout.splitlines()}
    assert "lmms-optim" in names and "torch" in names
    others = {n for n in names if n.startswith("lmms") and n != "lmms-optim"}
    assert not others, f"installing lmms-optim pulled other lmms packages: {others}"
