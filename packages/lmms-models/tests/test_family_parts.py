"""The family contract's composition rule (issue 35 point 3): a family is parts + presets +
checkpoint names. No family module imports another family (its private names least of all), no
family's spec subclasses another family's, and the families' own model code (``_model.py``)
holds no process-group logic and computes no loss."""

from __future__ import annotations

import ast
from pathlib import Path

import lmms_models
from lmms_models import get_model_spec, list_models

FAMILIES = Path(lmms_models.__file__).parent / "families"
FAMILY_PKG = "lmms_models.families."


def _imported_modules(path: Path, package: str) -> list[tuple[str, list[str]]]:
    """``(absolute module, imported names)`` of every ``from ... import`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _family_of(module: str) -> str | None:
    if not module.startswith(FAMILY_PKG):
        return None
    return module[len(FAMILY_PKG) :].split(".")[0]


def test_no_family_imports_another_family():
    bad = []
    for path in sorted(FAMILIES.glob("*/*.py")):
        own = path.parent.name
        package = FAMILY_PKG + own  # the module's package (a family folder)
        for mod, names in _imported_modules(path, package):
            other = _family_of(mod)
            if other == own and path.name == "__init__.py" and mod == package:
                continue
            if other is not None and other != own:
                private = [n for n in names if n.startswith("_")] or [
                    p for p in mod.split(".") if p.startswith("_")
                ]
                bad.append(f"{path.relative_to(FAMILIES)}: {mod} {names} (private: {private})")
    assert not bad, "families import each other (compose from lmms_models.parts):\n" + "\n".join(
        bad
    )


def test_the_check_sees_a_sibling_import(tmp_path):
    """The import walk resolves relative imports (what the check above relies on)."""
    f = tmp_path / "x.py"
    f.write_text("from ..qwen3_vl import _TINY\nfrom ...parts.text import tiny_text\n")
    mods = _imported_modules(f, FAMILY_PKG + "qwen3_vl_moe")
    assert mods[0] == ("lmms_models.families.qwen3_vl", ["_TINY"])
    assert _family_of(mods[0][0]) == "qwen3_vl" and _family_of(mods[1][0]) is None


def test_no_family_spec_subclasses_another_family():
    specs = {name: type(get_model_spec(name)) for name in list_models()}
    bad = []
    for name, cls in specs.items():
        for base in cls.__mro__[1:]:
            other = _family_of(base.__module__)
            if other is not None and other != name:
                bad.append(f"{name}: {cls.__name__} inherits {base.__module__}.{base.__name__}")
            if base in specs.values():
                bad.append(f"{name}: {cls.__name__} inherits the registered {base.__name__}")
    assert not bad, "\n".join(bad)


def test_family_model_code_is_single_device_and_loss_free():
    """``families/*/_model.py`` (the modules written here rather than taken from transformers or
    diffusers): no torch.distributed, no lmms_parallel, no cross-entropy."""
    banned_mods = ("torch.distributed", "lmms_parallel")
    banned_names = ("fused_linear_cross_entropy", "cross_entropy", "sp_group")
    files = sorted(FAMILIES.glob("*/_model.py"))
    assert files
    bad = []
    for path in files:
        tree = ast.parse(path.read_text())
        for mod, names in _imported_modules(path, FAMILY_PKG + path.parent.name):
            if mod.startswith(banned_mods) or set(names) & set(banned_names):
                bad.append(f"{path.relative_to(FAMILIES)} imports {mod} {names}")
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if isinstance(node, ast.arg):
                name = node.arg
            if name in banned_names or name == "distributed":
                bad.append(f"{path.relative_to(FAMILIES)}:{node.lineno} uses {name}")
    assert not bad, "\n".join(bad)
