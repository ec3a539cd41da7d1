"""The family contract (docs/contracts.md, "The family contract"), checked on the source.

- Callers of a model spec (the trainer, the objectives, lmms-parallel) use only hooks declared
  on ``ModelSpec`` (with their defaults) or on the capability protocols of
  ``lmms_models._capabilities``: no ``hasattr``/``getattr`` probing of a spec, and no check of
  which class defines a method.
- No registered family's name appears in the code of the trainer, lmms-parallel, lmms-kernels,
  lmms-pack or lmms-optim, nor in lmms-data outside its per-family processors
  (``lmms_data/processors/``): as an identifier or a code-like string (prose in messages and
  docstrings may name a family). No exceptions: a family states its Liger casting, its
  lmms-engine names and its demo-data kind itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Source trees that call spec hooks.
CALLERS = [
    ROOT / "apps/trainer/src",
    ROOT / "packages/lmms-models/src/lmms_models/objectives",
    ROOT / "packages/lmms-models/src/lmms_models/testing.py",  # every family's parity harness
    ROOT / "packages/lmms-models/src/lmms_models/testing_audio.py",
    ROOT / "packages/lmms-parallel/src",
]


def _sources(roots: list[Path]) -> list[Path]:
    """The ``.py`` files under each root (a root may be one file)."""
    return sorted(p for root in roots for p in ([root] if root.is_file() else root.rglob("*.py")))


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


#: Where family names may not appear (lmms-data's per-family processors are exempt).
NAME_FREE = [
    ROOT / "apps/trainer/src",
    ROOT / "packages/lmms-parallel/src",
    ROOT / "packages/lmms-kernels/src",
    ROOT / "packages/lmms-pack/src",
    ROOT / "packages/lmms-optim/src",
    ROOT / "packages/lmms-data/src",
]
NAME_EXEMPT = "packages/lmms-data/src/lmms_data/processors/"

_CODE_LIKE = re.compile(r"[A-Za-z0-9_.]+")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _words(node: ast.AST, docs: set[int]) -> list[str]:
    """The identifiers and code-like string constants of one AST node."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
        return [node.value] if _CODE_LIKE.fullmatch(node.value) else []
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    if isinstance(node, ast.arg):
        return [node.arg]
    return []


def family_names_in(path: Path, families: list[str], root: Path = ROOT) -> list[str]:
    """``file:line: name`` for each family name (lower case, between non-alphanumerics: ``_``
    separates, so ``render_wan`` names ``wan``) in ``path``'s identifiers and code-like strings."""
    alternatives = "|".join(sorted(map(re.escape, families), key=len, reverse=True))
    pattern = re.compile(rf"(?<![a-z0-9])({alternatives})(?![a-z0-9])")
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    return [
        f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}: {m.group(1)} ({word})"
        for node in ast.walk(tree)
        for word in _words(node, docs)
        for m in pattern.finditer(word)
    ]


def test_no_family_names_outside_the_families():
    from lmms_models import list_models

    families = list_models()
    over = []
    for path in _sources(NAME_FREE):
        if not path.relative_to(ROOT).as_posix().startswith(NAME_EXEMPT):
            over += family_names_in(path, families)
    assert not over, (
        "a family's own hook belongs on its spec (docs/contracts.md, 'The family contract'); "
        "found family names:\n" + "\n".join(over)
    )


def test_family_name_detector_finds(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        '"""Docstrings may name wan."""\n'
        "def render_wan(x):\n"
        '    if x == "sit":\n'
        '        raise ValueError("prose may name bagel")\n'
        "    return Qwen2RMSNorm\n"
    )
    found = family_names_in(src, ["wan", "sit", "bagel", "qwen2"], tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == ["wan (render_wan)", "sit (sit)"]


def objective_branches(path: Path, objectives: list[str], root: Path = ROOT) -> list[str]:
    """``file:line: source`` of each comparison with an objective's name (``objective ==
    "causal_lm"``, ``name in ("dpo", ...)``, ``!=``, ``not in``) in ``path``: a branch on which
    objective runs, where the objective should declare what the caller needs to know."""
    wanted = set(objectives)

    def names_one(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in wanted
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(names_one(e) for e in node.elts)
        return False

    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(names_one, [node.left, *node.comparators]))
    ]


def test_no_branching_on_objective_names():
    from lmms_models.objectives import list_objectives

    found = [
        hit for path in _sources(NAME_FREE) for hit in objective_branches(path, list_objectives())
    ]
    assert not found, (
        "declare what the caller needs as an attribute of the objective class "
        "(lmms_models.objectives.Objective: labelled_rows, vocab_parallel_head, layout_shift, "
        "preference, requires, ...) and read it; found comparisons with objective names:\n"
        + "\n".join(found)
    )


def test_objective_branch_detector_finds(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        'if objective != "causal_lm":\n    pass\n'
        'ok = m.objective in ("dpo", "other")\n'
        'fine = get_objective("causal_lm")  # naming a default is not a branch\n'
    )
    found = objective_branches(src, ["causal_lm", "dpo"], tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["x.py:1", "x.py:3"]


#: Model code (DESIGN.md, "The family contract": single-device and loss-free; process groups and
#: collectives come from lmms-parallel applying the family's plans, e.g. ``ModelSpec.sp_plan``).
SINGLE_DEVICE = [
    ROOT / "packages/lmms-models/src/lmms_models/families",
    ROOT / "packages/lmms-models/src/lmms_models/parts",
    # the family side of the SP vision split (the hooks and the gather: lmms_parallel.SplitVision)
    ROOT / "packages/lmms-models/src/lmms_models/_vision_split.py",
    # the packed linear-attention mixers (their SP: lmms_parallel's sp_linear_heads style)
    ROOT / "packages/lmms-models/src/lmms_models/_linear_attention.py",
]
_DISTRIBUTED = re.compile(r"torch\.distributed|from\s+torch\s+import\s+distributed|\bdist\.")


def distributed_uses(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: source`` of each line of ``path`` naming ``torch.distributed`` (or ``dist.``,
    its usual alias) in code, a comment or a docstring."""
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _DISTRIBUTED.search(line)
    ]


def test_model_code_is_single_device():
    assert all(p.exists() for p in SINGLE_DEVICE), [p for p in SINGLE_DEVICE if not p.exists()]
    found = [hit for path in _sources(SINGLE_DEVICE) for hit in distributed_uses(path)]
    assert not found, (
        "a family's collective belongs in lmms-parallel as a plan style (register_style('sp', "
        "...) / 'tp' / 'ep'), the family only states the plan (ModelSpec.sp_plan, tp_plan, "
        "ep_plan); found torch.distributed in model code:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "code",
    [
        "import torch.distributed as dist",
        "from torch import distributed",
        "n = torch.distributed.get_world_size(group)",
        "dist.all_gather(parts, x, group=group)",
    ],
)
def test_distributed_detector_finds(tmp_path, code):
    src = tmp_path / "x.py"
    src.write_text(f"{code}\nposterior = vae.encode(x).latent_dist\n")
    assert [f.split(": ", 1)[0] for f in distributed_uses(src, tmp_path)] == ["x.py:1"]
