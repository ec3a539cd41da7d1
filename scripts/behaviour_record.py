"""Every tiny example's losses at two commits, compared (issue 35, point 6: behaviour unchanged).

    python scripts/behaviour_record.py record --tree DIR --out FILE.json [--steps 6] [--only TEXT]
        [--reverse --until OTHER.json]     # a second process from the end, until the first's
    python scripts/behaviour_record.py parity --tree DIR --out FIGURES.json [TESTS ...]
    python scripts/behaviour_record.py compare BEFORE.json AFTER.json [--md FILE.md]
        [--parity BEFORE_FIGURES.json AFTER_FIGURES.json]

`record` trains each `examples/*/*tiny*.yaml` of the checkout DIR (a `git worktree` of the commit)
for `--steps` optimizer steps, each in its own scratch folder (the example's generated data and
processor too, so nothing is shared between the two commits), with the example's own seed and
these overrides only: `trainer_args.max_steps=N`, a fresh `output_dir`, no checkpoints
(`save_steps=0`, `save_final=false`), `report_to=[]`. The run is `python -m lmms_train` of this
interpreter with `PYTHONPATH` set to DIR's `packages/*/src` and `apps/trainer/src`, so the
commit's own code is imported (each run records the files its `lmms_*` modules came from, and the
record fails if one is not under DIR). Per example: the per-step `loss`, `grad_norm`, `eval_loss`
of its metrics.jsonl, the exit code, the wall time.

`parity` runs the parity tests (default: lmms-models' test_packed_parity.py) of DIR the same way,
with scripts/parity_figures.py recording each test's outcome, number of tensor comparisons and
largest absolute difference. `compare` prints (or writes as Markdown tables) each example's steps
and whether its losses, gradient norms and eval losses are bit-identical (the largest absolute
loss difference where not), and the parity figures of both commits side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PACKAGES = ("lmms_pack", "lmms_optim", "lmms_kernels", "lmms_parallel", "lmms_data",
             "lmms_models", "lmms_train")  # fmt: skip
# The child: report where each lmms module comes from, then run the CLI as `python -m lmms_train`.
_CHILD = (
    "import importlib, json, sys; "
    "print('LMMS_MODULES ' + json.dumps({n: importlib.import_module(n).__file__ for n in "
    f"{_PACKAGES!r}}}), flush=True); "
    "from lmms_train.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _pythonpath(tree: Path) -> str:
    srcs = sorted(str(p) for p in (tree / "packages").glob("*/src"))
    return os.pathsep.join([*srcs, str(tree / "apps" / "trainer" / "src")])


def _metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def record_one(tree: Path, example: Path, steps: int, scratch: Path) -> dict:
    """Train one example for `steps` steps in `scratch` (examples linked from the tree)."""
    scratch.mkdir(parents=True)
    (scratch / "examples").symlink_to(tree / "examples")
    out = scratch / "out"
    argv = [sys.executable, "-c", _CHILD, str(example.relative_to(tree)),
            f"trainer_args.max_steps={steps}", f"trainer_args.output_dir={out}",
            "trainer_args.save_steps=0", "trainer_args.save_final=false",
            "trainer_args.report_to=[]"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": _pythonpath(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    modules = {}
    for line in proc.stdout.splitlines():
        if line.startswith("LMMS_MODULES "):
            modules = json.loads(line.split(" ", 1)[1])
    foreign = {n: f for n, f in modules.items() if not Path(f).resolve().is_relative_to(tree)}
    if foreign:
        raise SystemExit(f"{example}: imported from outside {tree}: {foreign}")
    rows = [r for r in _metrics(out / "metrics.jsonl") if "loss" in r or "eval_loss" in r]
    train = [r for r in rows if "loss" in r]
    return {
        "returncode": proc.returncode,
        "seconds": round(seconds, 1),
        "steps": [r["step"] for r in train],
        "loss": [r["loss"] for r in train],
        "grad_norm": [r.get("grad_norm") for r in train],
        "eval_loss": {str(r["step"]): r["eval_loss"] for r in rows if "eval_loss" in r},
        "modules": modules,
        "tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:],
    }


def _recorded(path: Path | None) -> set[str]:
    try:
        return set(json.loads(path.read_text())["examples"]) if path else set()
    except (OSError, ValueError):
        return set()


def record(tree: Path, out: Path, steps: int, only: str, *, reverse: bool = False,
           until: Path | None = None) -> int:  # fmt: skip
    """`reverse` with `until` (another record's file, going forward): a second process that
    starts from the end and stops where the first has got to."""
    tree = tree.resolve()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    result = {"commit": commit, "tree": str(tree), "steps": steps, "python": sys.executable,
              "examples": {}}  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="lmms-behaviour-"))
    for example in sorted((tree / "examples").glob("*/*tiny*.yaml"), reverse=reverse):
        name = str(example.relative_to(tree))
        if only not in name:
            continue
        if name in _recorded(until):
            break
        r = record_one(tree, example, steps, root / name.replace("/", "__"))
        result["examples"][name] = r
        print(f"{r['returncode']:3d} {r['seconds']:7.1f}s {name} {r['loss']}", flush=True)
        out.write_text(json.dumps(result, indent=1))  # as it goes
    return 0


PARITY_TESTS = ("packages/lmms-models/tests/test_packed_parity.py",)


def parity(tree: Path, out: Path, tests: list[str]) -> int:
    """Run the parity tests of the checkout `tree` with its own packages, recording each
    comparison's figures (scripts/parity_figures.py) into `out`."""
    tree = tree.resolve()
    plugin = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{_pythonpath(tree)}{os.pathsep}{plugin}",
           "PYTHONDONTWRITEBYTECODE": "1", "PARITY_FIGURES_OUT": str(out)}  # fmt: skip
    argv = [sys.executable, "-m", "pytest", "-p", "parity_figures", "-p", "no:cacheprovider",
            "-q", *(tests or PARITY_TESTS)]  # fmt: skip
    return subprocess.run(argv, cwd=tree, env=env).returncode


def parity_markdown(before: dict, after: dict) -> str:
    """Per parity test id of either commit: outcome, comparisons, largest |difference|."""
    lines = ["| test | before: outcome, comparisons, max abs diff | after | same figures? |",
             "|---|---|---|---|"]  # fmt: skip

    def cell(f: dict | None) -> str:
        if f is None:
            return "-"
        return f"{f.get('outcome', '?')}, {f['comparisons']}, {f['max_abs']:.3g}"

    for test in sorted(set(before) | set(after)):
        b, a = before.get(test), after.get(test)
        same = "-" if b is None or a is None else (
            "yes" if (b.get("outcome"), b["comparisons"], b["max_abs"])
            == (a.get("outcome"), a["comparisons"], a["max_abs"]) else "no")  # fmt: skip
        lines.append(f"| `{test}` | {cell(b)} | {cell(a)} | {same} |")
    return "\n".join(lines) + "\n"


def _diff(a: list, b: list) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    return max((abs(x - y) for x, y in pairs), default=None)


def compare(before: dict, after: dict) -> list[dict]:
    """One row per example of either record: steps, losses, identical?"""
    rows = []
    for name in sorted(set(before["examples"]) | set(after["examples"])):
        b, a = before["examples"].get(name), after["examples"].get(name)
        row = {"example": name, "before": b, "after": a}
        if b is None or a is None:
            row["equal"] = "only after" if b is None else "only before"
        elif b["returncode"] or a["returncode"] or not b["loss"]:
            row["equal"] = f"exit {b['returncode']} / {a['returncode']}"
        else:
            same = all(b[k] == a[k] for k in ("loss", "grad_norm", "eval_loss"))
            row["equal"] = (
                "identical" if same else f"differs (max {_diff(b['loss'], a['loss']):.3g})"
            )
        rows.append(row)
    return rows


def _fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    return ", ".join(f"{x:.6f}" for x in r["loss"]) or f"exit {r['returncode']}"


def markdown(before: dict, after: dict) -> str:
    lines = [
        f"Before: `{before['commit'][:10]}`, after: `{after['commit'][:10]}`, "
        f"{after['steps']} steps each.",
        "",
        "| example | steps | before (loss per step) | after (loss per step) | equal? |",
        "|---|---|---|---|---|",
    ]
    for row in compare(before, after):
        b, a = row["before"], row["after"]
        steps = len((a or b)["loss"])
        lines.append(f"| `{row['example']}` | {steps} | {_fmt(b)} | {_fmt(a)} | {row['equal']} |")
    return "\n".join(lines) + "\n"


def _merged(files: str) -> dict:
    """One record from `A.json,B.json` (parts of one commit's record: `--reverse --until`)."""
    parts = [json.loads(Path(f).read_text()) for f in files.split(",")]
    if len({p["commit"] for p in parts}) != 1:
        raise SystemExit(f"{files}: records of different commits")
    merged = {**parts[0], "examples": {}}
    for part in parts:
        merged["examples"].update(part["examples"])
    return merged


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--only", default="")
    r.add_argument("--reverse", action="store_true")
    r.add_argument("--until", type=Path)
    q = sub.add_parser("parity")
    q.add_argument("--tree", type=Path, required=True)
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("tests", nargs="*")
    c = sub.add_parser("compare")
    c.add_argument("before", help="its record (FILE.json, or FILE.json,PART2.json)")
    c.add_argument("after")
    c.add_argument("--md", type=Path)
    c.add_argument("--parity", nargs=2, metavar=("BEFORE.json", "AFTER.json"))
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args.tree, args.out, args.steps, args.only, reverse=args.reverse,
                      until=args.until)  # fmt: skip
    if args.cmd == "parity":
        return parity(args.tree, args.out, args.tests)
    before, after = (_merged(f) for f in (args.before, args.after))
    text = markdown(before, after)
    if args.parity:
        figures = [json.loads(Path(f).read_text()) for f in args.parity]
        text += "\n" + parity_markdown(*figures)
    if args.md:
        args.md.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
