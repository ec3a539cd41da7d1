"""The family contract (docs/contracts.md, "The family contract"), checked on the source.

- Callers of a model spec (the trainer, the objectives, lmms-parallel) use only hooks declared
  on ``ModelSpec`` (with their defaults) or on the capability protocols of
  ``lmms_models._capabilities``: no ``hasattr``/``getattr`` probing of a spec, and no check of
  which class defines a method.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Source trees that call spec hooks.
CALLERS = [
    ROOT / "apps/trainer/src",
    ROOT / "packages/lmms-models/src/lmms_models/objectives",
    ROOT / "packages/lmms-parallel/src",
]


def _sources(roots: list[Path]) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _names_spec(node: ast.expr) -> bool:
    """``spec``, ``self.spec``, ``run.spec``, ``type(spec)``, ...: an expression naming a spec."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
        return bool(node.args) and _names_spec(node.args[0])
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name == "spec" or name.endswith("_spec")


def spec_probes(path: Path, root: Path = ROOT) -> list[str]:
    """``hasattr(spec, ...)`` / ``getattr(spec, ...)`` calls and ``type(spec).hook is ...``
    comparisons in ``path``, as ``file:line: source``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        hit = (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and node.args
            and _names_spec(node.args[0])
        ) or (
            isinstance(node, ast.Compare)
            and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
            and isinstance(node.left, ast.Attribute)
            and _names_spec(node.left.value)
        )
        if hit:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_probing_of_spec_hooks():
    probes = [p for path in _sources(CALLERS) for p in spec_probes(path)]
    assert not probes, (
        "declare the hook on ModelSpec (with its default) or on a capability protocol "
        "(lmms_models._capabilities) and call it; do not probe:\n" + "\n".join(probes)
    )


@pytest.mark.parametrize(
    "code",
    [
        "hasattr(spec, 'finish_pack')",
        "getattr(run.spec, 'pack_flops', None)",
        "type(spec).vision_split_plan is not ModelSpec.vision_split_plan",
    ],
)
def test_probe_detector_finds(tmp_path, code):
    """The detector itself: each form of probing is found."""
    src = tmp_path / "x.py"
    src.write_text(f"x = {code}\n")
    assert spec_probes(src, tmp_path)
