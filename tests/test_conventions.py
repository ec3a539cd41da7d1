"""Workspace conventions that review would otherwise keep repeating (shared/STYLE.md, DESIGN.md).

- ruff lint and format are clean on the whole workspace;
- every package under packages/ and apps/ has py.typed, README.md, tests/ and ``__all__``;
- import boundaries: dependencies flow one way (DESIGN.md), checked on the source with ``ast``
  and against each pyproject's declared dependencies;
- importing a package opens no network connection.

A package that has no ``__init__.py`` yet (an empty skeleton) xfails its own cases only.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DESIGN.md, "Dependencies flow one way": the lmms packages each may import.
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "lmms_pack": set(),
    "lmms_optim": set(),
    "lmms_kernels": set(),
    "lmms_parallel": set(),
    "lmms_data": {"lmms_pack"},
    "lmms_models": {"lmms_kernels", "lmms_parallel"},
    "lmms_train": {
        "lmms_pack",
        "lmms_optim",
        "lmms_kernels",
        "lmms_parallel",
        "lmms_data",
        "lmms_models",
    },
}


def _packages() -> list[tuple[str, Path, Path]]:
    """(import name, package dir, source dir) for every workspace member."""
    found = []
    for manifest in sorted(
        [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
    ):
        meta = tomllib.loads(manifest.read_text())
        (src,) = meta["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
        found.append((Path(src).name, manifest.parent, manifest.parent / src))
    return found


PACKAGES = _packages()
IDS = [name for name, _, _ in PACKAGES]


def _require_init(src: Path) -> Path:
    init = src / "__init__.py"
    if not init.exists():
        pytest.xfail(f"{src.relative_to(ROOT)} has no __init__.py yet: an empty package skeleton")
    return init


def _lmms_imports(path: Path) -> list[tuple[str, int]]:
    """Top-level lmms_* modules imported anywhere in a file (relative imports excluded)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out += [(n.split(".")[0], node.lineno) for n in names if n.startswith("lmms_")]
    return out


def _ruff() -> list[str] | None:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    return [sys.executable, "-m", "ruff"] if probe.returncode == 0 else None


def test_workspace_members_are_known():
    assert set(IDS) == set(ALLOWED_IMPORTS), "add new packages to ALLOWED_IMPORTS (DESIGN.md)"


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff_clean(args):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the workspace's dev group)")
    proc = subprocess.run([*ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{(proc.stdout + proc.stderr)[-6000:]}"


@pytest.mark.parametrize(("name", "pkg", "src"), PACKAGES, ids=IDS)
def test_package_layout(name, pkg, src):
    init = _require_init(src)
    assert (src / "py.typed").is_file(), f"{src} has no py.typed"
    assert (pkg / "README.md").is_file(), f"{pkg} has no README.md"
    assert any((pkg / "tests").glob("test_*.py")), f"{pkg}/tests has no test_*.py"
    tree = ast.parse(init.read_text())
    exported, bound, lazy = None, set(), False
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    bound.add(t.id)
                    if t.id == "__all__":
                        exported = ast.literal_eval(node.value)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
            lazy |= node.name == "__getattr__"
    assert exported, f"{init} defines no __all__ (the public API)"
    missing = [n for n in exported if n not in bound]
    assert lazy or not missing, f"{init}: __all__ names not defined there: {missing}"


@pytest.mark.parametrize(("name", "pkg", "src"), PACKAGES, ids=IDS)
def test_import_boundaries(name, pkg, src):
    _require_init(src)
    allowed = ALLOWED_IMPORTS[name] | {name}
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {mod}"
        for path in sorted(src.rglob("*.py"))
        for mod, line in _lmms_imports(path)
        if mod not in allowed
    ]
    assert not bad, (
        f"{name} may import only {sorted(ALLOWED_IMPORTS[name]) or 'no other lmms package'}:\n"
        + "\n".join(bad)
    )
    # Whatever it imports of its siblings it must also declare (and may declare no more).
    deps = tomllib.loads((pkg / "pyproject.toml").read_text())["project"].get("dependencies", [])
    declared = {re.match(r"[A-Za-z0-9_.-]+", d).group().replace("-", "_").lower() for d in deps}
    declared_lmms = {d for d in declared if d.startswith("lmms_")}
    assert declared_lmms <= ALLOWED_IMPORTS[name], f"{pkg.name} declares {sorted(declared_lmms)}"
    used = {mod for path in src.rglob("*.py") for mod, _ in _lmms_imports(path)} - {name}
    assert used <= declared_lmms, (
        f"{pkg.name} imports {sorted(used - declared_lmms)} without declaring them"
    )


_NO_NETWORK = """
import importlib, json, socket, sys, traceback
attempts = []
def _blocked(name):
    def block(*args, **kwargs):
        attempts.append(f"{name}{args[1:] if name.startswith('socket.') else args}")
        raise OSError(f"network access at import time: {name}")
    return block
for attr in ("connect", "connect_ex", "sendto"):
    setattr(socket.socket, attr, _blocked(f"socket.{attr}"))
socket.create_connection = _blocked("create_connection")
socket.getaddrinfo = _blocked("getaddrinfo")
report = {}
for name in sys.argv[1:]:  # one process: torch & co. are imported once for all packages
    del attempts[:]
    try:
        importlib.import_module(name)
        error = None
    except BaseException:
        error = traceback.format_exc()[-3000:]
    report[name] = {"attempts": list(attempts), "error": error}
print(json.dumps(report))
"""


@functools.cache
def _import_report() -> dict:
    names = [name for name, _, src in PACKAGES if (src / "__init__.py").exists()]
    proc = subprocess.run(
        [sys.executable, "-c", _NO_NETWORK, *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("name", "pkg", "src"), PACKAGES, ids=IDS)
def test_no_network_at_import(name, pkg, src):
    _require_init(src)
    result = _import_report()[name]
    assert result["error"] is None, (
        f"import {name} failed with the network blocked:\n{result['error']}"
    )
    assert not result["attempts"], f"import {name} tried the network: {result['attempts']}"
