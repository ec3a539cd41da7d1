"""Every package is ready to publish: LICENSE in the wheel, classifiers, project URLs, absolute
README links, bounded versions between workspace packages; each wheel installs into a fresh
environment with only its declared dependencies and runs its README's first example (lmms-pack
and lmms-optim have their own install tests in their packages)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECTS = sorted([*REPO.glob("packages/*/pyproject.toml"), *REPO.glob("apps/*/pyproject.toml")])
WORKSPACE = {tomllib.loads(p.read_text())["project"]["name"]: p.parent for p in PROJECTS}
PYTHONS = ("3.11", "3.12", "3.13")
# what a README's example needs beyond the package, as its README says (`pip install ...`)
README_EXTRAS = {"lmms-parallel": ["transformers"]}


def _project(name: str) -> dict:
    return tomllib.loads((WORKSPACE[name] / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("name", sorted(WORKSPACE))
def test_metadata_is_complete(name):
    proj = _project(name)
    assert proj["license"] == "Apache-2.0" and proj["license-files"] == ["LICENSE"]
    assert (WORKSPACE[name] / "LICENSE").read_text() == (REPO / "LICENSE").read_text()
    classifiers = proj["classifiers"]
    for py in PYTHONS:
        assert f"Programming Language :: Python :: {py}" in classifiers
    assert {"Homepage", "Repository", "Documentation", "Issues", "Changelog"} <= set(proj["urls"])
    reqs = proj["dependencies"] + [
        r for v in proj.get("optional-dependencies", {}).values() for r in v
    ]
    for req in reqs:
        dep = re.match(r"[a-z0-9-]+", req).group(0)
        if dep in WORKSPACE:  # released together: same minor version, bounded above
            assert re.search(r">=\d+\.\d+\.\d+,<\d+\.\d+$", req), f"{name}: unbounded {req!r}"
    readme = (WORKSPACE[name] / proj["readme"]).read_text()
    base = proj["urls"]["Repository"]
    for link in re.findall(r"\]\(([^)\s]+)\)", readme):
        assert link.startswith(("https://", "http://", "#")), f"{name} README: relative link {link}"
        if link.startswith("https://github.com/"):
            assert link.startswith(base), f"{name} README: {link} is not under {base}"


def test_root_config_has_no_machine_settings():
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    uv = root.get("tool", {}).get("uv", {})
    assert not {"python-preference", "python-downloads"} & set(uv), "keep these in CI's environment"
    assert (REPO / "CHANGELOG.md").is_file()
    publish = (REPO / ".github" / "workflows" / "publish.yml").read_text()
    assert (
        "tags:" in publish and "id-token: write" in publish and "gh-action-pypi-publish" in publish
    )


@pytest.mark.parametrize("name", sorted(n for n in WORKSPACE if n != "lmms-train"))
def test_package_workflow_triggers_on_its_dependencies(name):
    text = (REPO / ".github" / "workflows" / f"{name}.yml").read_text()
    deps = [re.match(r"[a-z0-9-]+", r).group(0) for r in _project(name)["dependencies"]]
    for dep in [name, *(d for d in deps if d in WORKSPACE)]:
        assert f'"packages/{dep}/**"' in text, (name, dep)
    assert '"uv.lock"' in text and "enable-cache: true" in text
    assert all(f'"{py}"' in text for py in PYTHONS)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([uv, "build", "--all-packages", "--wheel", "--out-dir", str(dist)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return dist


def test_every_wheel_ships_license_and_metadata(wheels):
    found = sorted(wheels.glob("*.whl"))
    assert len(found) == len(WORKSPACE)
    for whl in found:
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), whl.name
            meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in meta and "Project-URL: Repository" in meta
        assert "Classifier: Programming Language :: Python :: 3.13" in meta


def _readme_block(name: str, lang: str) -> str:
    text = (WORKSPACE[name] / "README.md").read_text()
    blocks = re.findall(rf"```{lang}\n(.*?)```", text, re.S)
    assert blocks, f"{name} README has no {lang} block"
    return blocks[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lmms-data", "lmms-kernels", "lmms-parallel", "lmms-models", "lmms-train"])  # fmt: skip
def test_wheel_installs_alone_and_runs_its_readme(name, wheels, tmp_path):
    uv = shutil.which("uv")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")

    def run(*a, **kw):
        return subprocess.run(a, capture_output=True, text=True, env=env, timeout=900, **kw)

    venv = tmp_path / "venv"
    assert run(uv, "venv", "--python", sys.executable, str(venv)).returncode == 0
    py = str(venv / "bin" / "python")
    extras = README_EXTRAS.get(name, [])
    for extra in extras:
        assert f"pip install {name} {extra}" in (WORKSPACE[name] / "README.md").read_text()
    r = run(uv, "pip", "install", "--python", py, "--link-mode", "hardlink", "--find-links",
            str(wheels), name, *extras)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(uv, "pip", "list", "--python", py, "--format", "freeze")
    installed = {ln.split("==")[0].lower() for ln in r.stdout.splitlines()}
    needed = {d for d in WORKSPACE if d == name or d in _closure(name)}
    assert {n for n in installed if n.startswith("lmms-")} == needed, installed
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    if name == "lmms-train":  # the README's first command, from a folder holding the examples
        shutil.copytree(REPO / "examples" / "quickstart", cwd / "examples" / "quickstart")
        cmd = _readme_block(name, "bash").splitlines()[0].split("#")[0].split()
        cmd = [str(venv / "bin" / cmd[0]), *cmd[1:], "trainer_args.max_steps=2"]
    else:
        code = _readme_block(name, "python").replace('"/tmp/', f'"{tmp_path}/')
        (cwd / "example.py").write_text(code)
        cmd = [py, "example.py"]
        if "torchrun" in code.splitlines()[0]:
            cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node=2", "example.py"]
    r = run(*cmd, cwd=cwd)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


def _closure(name: str) -> set[str]:
    out: set[str] = set()
    for req in _project(name)["dependencies"]:
        dep = re.match(r"[a-z0-9-]+", req).group(0)
        if dep in WORKSPACE and dep not in out:
            out |= {dep} | _closure(dep)
    return out
