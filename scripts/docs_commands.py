"""Every shell command of docs/*.md and of the example YAMLs' comments, extracted and run.

    python scripts/docs_commands.py --list     # every command, where it is, and how it is checked
    python scripts/docs_commands.py            # run the CPU ones for real (minutes), in a scratch copy

Two layers, so that the docs cannot drift:

* the suite (`tests/test_docs_commands.py`, seconds): every command found here is classified;
  each training command's config loads with its overrides and passes the run's preflight; each
  subcommand's arguments are accepted (run where its inputs do not exist: the error must name a
  missing input, never the usage line);
* this script (slow, not in CI): the `cpu` commands are run as written, in order of appearance
  per file (a render after the training that writes its checkpoint), in a scratch copy of the
  tracked files, each with its wall time; a failure exits 1.

Kinds: `cpu` (runs on a laptop: the tiny examples, named `*tiny*.yaml`, their render/sample),
`gpu` (needs CUDA GPUs and real weights: every other config, GPU benchmarks, `-m gpu` tests),
`network` (pip / hf downloads), `template` (placeholders such as CONFIG.yaml, `[...]`), `data`
(reads a real data set, e.g. under /data), `suite` (the test suite itself).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
_STARTS = ("uv run", "lmms-train", "torchrun", "python", "pip", "hf ", "UV_TORCH_BACKEND")
_PLACEHOLDERS = re.compile(r"CONFIG\.yaml|ENGINE\.yaml|engine_config\.yaml|\[\.\.\.\]|\[--|/path/")
SUBCOMMANDS = ("render", "sample", "plot", "check-data", "convert-config", "precompute", "plan",
               "export", "docs", "launch")  # fmt: skip


@dataclass(frozen=True, slots=True)
class DocCommand:
    file: str  # relative to the repository
    line: int
    text: str  # as written, continuation lines joined, the trailing comment removed

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def lmms_args(self) -> list[str] | None:
        """The arguments after `lmms-train` / `-m lmms_train` (None: not an lmms-train call)."""
        argv = self.argv
        for i, a in enumerate(argv):
            if a == "lmms-train" or (a == "lmms_train" and argv[i - 1] == "-m"):
                return argv[i + 1 :]
        return None

    @property
    def nproc(self) -> int:
        m = re.search(r"--nproc_per_node[= ](\d+)", self.text)
        return int(m.group(1)) if m else 1

    @property
    def kind(self) -> str:
        args = self.lmms_args
        if re.match(r"(pip|hf|UV_TORCH_BACKEND)\b", self.text):
            return "network"
        if _PLACEHOLDERS.search(self.text):
            return "template"
        if args is None:
            if "pytest" in self.text:
                return "gpu" if "-m gpu" in self.text else "suite"
            return "gpu"  # benchmarks: GPU scripts (benchmarks/README.md)
        if self.nproc > 2:
            return "gpu"
        if any(a.startswith("/data") or "=/data/" in a for a in args):
            return "data"  # a real data set on the machine
        config = next((a for a in args if a.endswith(".yaml")), None)
        if args and args[0] not in SUBCOMMANDS and config and "tiny" not in Path(config).name:
            return "gpu"  # the CPU examples are the tiny ones (examples/*/tiny_cpu*.yaml, ...)
        return "cpu"


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    cur, start = "", 0
    for no, text in lines:
        if not cur:
            start = no
        if text.endswith("\\"):
            cur += text[:-1].rstrip() + " "
            continue
        out.append((start, cur + text))
        cur = ""
    return out


def extract(repo: Path = REPO) -> list[DocCommand]:
    """Every command of docs/*.md (bash blocks) and of examples/**/*.yaml (comment lines)."""
    found: list[DocCommand] = []
    for md in sorted((repo / "docs").glob("*.md")):
        text = md.read_text()
        for block in _BLOCK.finditer(text):
            first = text.count("\n", 0, block.start(1)) + 1
            lines = [(first + i, ln.strip()) for i, ln in enumerate(block.group(1).splitlines())]
            lines = [(n, t) for n, t in lines if t and not t.startswith("#")]
            for no, cmd in _joined(lines):
                found.append(DocCommand(str(md.relative_to(repo)), no, _requote(cmd)))
    for yml in sorted((repo / "examples").rglob("*.yaml")):
        lines, cont = [], False
        for no, raw in enumerate(yml.read_text().splitlines(), 1):
            if not raw.startswith("#"):
                cont = False
                continue
            text = raw.lstrip("#").strip()
            if cont or text.startswith(_STARTS):
                lines.append((no, text))
                cont = text.endswith("\\")
        for no, cmd in _joined(lines):
            found.append(DocCommand(str(yml.relative_to(repo)), no, _requote(cmd)))
    return found


def _requote(cmd: str) -> str:
    """The command with its trailing `# comment` removed, arguments quoted as needed."""
    try:
        return shlex.join(shlex.split(cmd, comments=True))
    except ValueError:
        return cmd


def _scratch() -> Path:
    root = Path(tempfile.mkdtemp(prefix="lmms-docs-"))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for rel in filter(None, files.stdout.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    return root


def _run(cmd: DocCommand, cwd: Path) -> tuple[int, float, str]:
    argv = cmd.argv
    if argv[:2] == ["uv", "run"]:  # this checkout's environment, never a sync
        argv = ["uv", "run", "--no-sync", "--project", str(REPO), *argv[2:]]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=1800)
    return proc.returncode, time.perf_counter() - t0, (proc.stdout + proc.stderr)[-2000:]


def main(argv: list[str]) -> int:
    commands = extract()
    if "--list" in argv:
        for c in commands:
            print(f"{c.kind:8s} {c.file}:{c.line}  {c.text}")
        return 0
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    cwd, failed = _scratch(), 0
    print(f"scratch copy: {cwd}", flush=True)
    for c in commands:
        if c.kind != "cpu" or only not in f"{c.file} {c.text}":
            continue
        code, seconds, tail = _run(c, cwd)
        print(f"{'ok  ' if code == 0 else 'FAIL'} {seconds:7.1f}s {c.file}:{c.line}  {c.text}")
        if code != 0:
            failed += 1
            print("    " + tail.replace("\n", "\n    "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
