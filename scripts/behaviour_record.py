"""Every tiny example's losses at two commits, compared (issue 35, point 6: behaviour unchanged).

    python scripts/behaviour_record.py record --tree DIR --out FILE.json [--steps 6] [--only TEXT]
    python scripts/behaviour_record.py compare BEFORE.json AFTER.json [--md FILE.md]

`record` trains each `examples/*/*tiny*.yaml` of the checkout DIR (a `git worktree` of the commit)
for `--steps` optimizer steps, each in its own scratch folder (the example's generated data and
processor too, so nothing is shared between the two commits), with the example's own seed and
these overrides only: `trainer_args.max_steps=N`, a fresh `output_dir`, no checkpoints
(`save_steps=0`, `save_final=false`), `report_to=[]`. The run is `python -m lmms_train` of this
interpreter with `PYTHONPATH` set to DIR's `packages/*/src` and `apps/trainer/src`, so the
commit's own code is imported (each run records the files its `lmms_*` modules came from, and the
record fails if one is not under DIR). Per example: the per-step `loss`, `grad_norm`, `eval_loss`
of its metrics.jsonl, the exit code, the wall time.

`compare` prints (or writes as a Markdown table) each example's steps and whether the losses are
bit-identical, with the largest absolute difference where they are not.
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


def record(tree: Path, out: Path, steps: int, only: str) -> int:
    tree = tree.resolve()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    result = {"commit": commit, "tree": str(tree), "steps": steps, "python": sys.executable,
              "examples": {}}  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="lmms-behaviour-"))
    for example in sorted((tree / "examples").glob("*/*tiny*.yaml")):
        name = str(example.relative_to(tree))
        if only not in name:
            continue
        r = record_one(tree, example, steps, root / name.replace("/", "__"))
        result["examples"][name] = r
        print(f"{r['returncode']:3d} {r['seconds']:7.1f}s {name} {r['loss']}", flush=True)
        out.write_text(json.dumps(result, indent=1))  # as it goes
    return 0


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
            same = b["loss"] == a["loss"] and b["eval_loss"] == a["eval_loss"]
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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--only", default="")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--md", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args.tree, args.out, args.steps, args.only)
    before, after = (json.loads(Path(f).read_text()) for f in (args.before, args.after))
    text = markdown(before, after)
    if args.md:
        args.md.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
