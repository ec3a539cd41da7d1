"""Every shell command of docs/*.md and of the example YAMLs' comments, extracted and run.

    python scripts/docs_commands.py --list     # every command, where it is, and how it is checked
    python scripts/docs_commands.py            # run the CPU ones for real (minutes), in a scratch copy
    python scripts/docs_commands.py --markdown docs/docs-commands.md [--only TEXT] [--timeout S]

Found: the commands of fenced `bash`/`sh`/`console` blocks and of 4-space-indented lines of
docs/*.md, inline code spans that are whole `lmms-train` commands (`lmms-train docs >
docs/config.md`; a bare `lmms-train plan` names the subcommand and is no command), and the
comment lines of examples/**/*.yaml that start like a command.

Two layers, so that the docs cannot drift:

* the suite (`tests/test_docs_commands.py`, seconds): every command found here is classified;
  the `fast` ones (`cpu` commands that take seconds: `--help`, `--version`, `docs`, `plan`,
  `convert-config`, `check-data`) are run as written, in process, in a scratch copy; each
  training command's config loads with its overrides and passes the run's preflight; each other
  subcommand's arguments are accepted (run where its inputs do not exist: the error must name a
  missing input, never the usage line);
* this script (slow, not in CI): the `cpu` commands are run as written (by bash), in order of
  appearance per file (a render after the training that writes its checkpoint), in a scratch copy
  of the tracked files, each with its wall time; a failure exits 1. `--markdown FILE` writes the
  results as a table (docs/docs-commands.md).

Kinds: `cpu` (runs on a laptop: the tiny examples, named `*tiny*.yaml`, their render/sample),
`gpu` (needs CUDA GPUs and real weights: every other config, GPU benchmarks, `-m gpu` tests),
`network` (pip / hf downloads), `template` (placeholders such as CONFIG.yaml, RUN/hf, `[...]`),
`data` (reads a real data set, e.g. under /data), `suite` (the test suite itself), `script` (the
slow runners of scripts/, this one among them, and their git set-up).
"""

from __future__ import annotations

import os
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
_INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:uv run [^`]*?)?lmms-train [^`]+)`")
_INDENTED = re.compile(r"^    ((?:uv run|lmms-train|torchrun|python) .*)$", re.M)
# CONFIG.yaml, RUN/hf, CHECKPOINT_DIR, FILE, TEXT, ... (an upper-case word that is no VAR=value)
_PLACEHOLDERS = re.compile(r"engine_config\.yaml|(?<![\w.])run\.yaml|\[\.\.\.\]|\[--|/path/|"
                           r"(?<![\w=/.-])[A-Z][A-Z_]{2,}(?![\w=])|\.\.\.")  # fmt: skip
SUBCOMMANDS = (
    "render",
    "sample",
    "plot",
    "check-data",
    "convert-config",
    "precompute",
    "plan",
    "docs",
    "launch",
)  # fmt: skip; the CLI's (tests/test_docs_commands.py checks)
# cpu commands of seconds, run in the suite: these subcommands and the top-level flags
FAST = ("docs", "plan", "convert-config", "check-data", "--help", "-h", "--version")
GENERATED = ("docs-commands.md",)  # this script's own table: commands quoted, not documented
SLOW = ("bagel", "sit/", "sit_", "wan/", "wan_")  # tens of minutes on a loaded CPU: run last
_SHELL = {">", ">>", "|", "&&", "||", ";", "2>&1"}  # kept unquoted: the command is run by bash


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
            if re.search(r"\bscripts/\w+\.py", self.text) or self.text.startswith("git "):
                return "script"  # the slow runners themselves (this one, behaviour_record.py)
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

    @property
    def fast(self) -> bool:
        """A `cpu` command of seconds (the suite runs it): see `FAST`."""
        args = self.lmms_args
        return self.kind == "cpu" and bool(args) and (args[0] in FAST or "--help" in args)


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


def _markdown_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of one Markdown page, in order: fenced shell blocks, 4-space-indented
    command lines, inline `lmms-train ...` spans with an argument beyond the subcommand."""
    found: list[tuple[int, str]] = []
    fenced: list[tuple[int, int]] = []
    for block in _BLOCK.finditer(text):
        fenced.append((block.start(), block.end()))
        first = text.count("\n", 0, block.start(1)) + 1
        lines = [(first + i, ln.strip()) for i, ln in enumerate(block.group(1).splitlines())]
        found += _joined([(n, t) for n, t in lines if t and not t.startswith("#")])
    outside = [m for m in [*_INDENTED.finditer(text), *_INLINE.finditer(text)]
               if not any(a <= m.start() < b for a, b in fenced)]  # fmt: skip
    for m in outside:
        words = m.group(1).split()
        rest = words[words.index("lmms-train") + 1 :]
        if rest and (rest[0] not in SUBCOMMANDS or len(rest) > 1):  # not a bare name
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1).strip()))
    return sorted(found)


def extract(repo: Path = REPO) -> list[DocCommand]:
    """Every command of docs/*.md and of examples/**/*.yaml (comment lines)."""
    found: list[DocCommand] = []
    for md in sorted((repo / "docs").glob("*.md")):
        if md.name in GENERATED:
            continue
        for no, cmd in _markdown_commands(md.read_text()):
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
        words = shlex.split(cmd, comments=True)
    except ValueError:
        return cmd
    return " ".join(w if w in _SHELL else shlex.quote(w) for w in words)


def _scratch() -> Path:
    root = Path(tempfile.mkdtemp(prefix="lmms-docs-"))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for rel in filter(None, files.stdout.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    return root


def _run(cmd: DocCommand, cwd: Path, timeout: float) -> tuple[int, float, str]:
    """Run the command as written by bash in `cwd`; `uv run` uses this checkout's environment
    (never a sync), a bare `lmms-train` / `python` this interpreter's."""
    text = cmd.text
    if text.startswith("uv run "):
        text = f"uv run --no-sync --project {shlex.quote(str(REPO))} " + text[len("uv run ") :]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(
            errors="replace"
        )
        return 124, time.perf_counter() - t0, f"timed out after {timeout:.0f} s\n{out[-1500:]}"
    return proc.returncode, time.perf_counter() - t0, (proc.stdout + proc.stderr)[-2000:]


def _in_run_order(commands: list[DocCommand]) -> list[DocCommand]:
    """Per file in order of appearance (a render after its training); the files whose commands
    train the slow examples (`SLOW`) last, so that a run cut short has done the rest."""
    files = list(dict.fromkeys(c.file for c in commands))
    slow = {f for f in files if any(w in c.text for c in commands if c.file == f for w in SLOW)}
    order = sorted(files, key=lambda f: f in slow)
    return [c for f in order for c in commands if c.file == f]


def _markdown(order: list[DocCommand], results: dict[int, tuple[int, float]], commit: str) -> str:
    """The run's results as a Markdown table: every command, in run order, run or only listed
    (`results`: by index in `order`; seconds 0 for a command that ran above)."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    ran = list(results.values())
    lines = [
        "# Docs commands: the last full run",
        "",
        f"`python scripts/docs_commands.py --markdown docs/docs-commands.md` on {date}, commit "
        f"`{commit[:10]}`, in a scratch copy of the tracked files on a shared 2-core CPU machine "
        f"(wall times include waiting for the cores): {sum(c == 0 for c, _ in ran)} of "
        f"{len(ran)} `cpu` commands passed, in {sum(s for _, s in ran) / 60:.0f} min. The "
        "`fast` ones also run in the suite (tests/test_docs_commands.py); the other kinds are "
        'listed, not run (docs/trainer.md, "Docs commands").',
        "",
        "| where | kind | command | wall | result |",
        "|---|---|---|---|---|",
    ]
    for i, c in enumerate(order):
        code, seconds = results.get(i, (None, 0.0))
        result = "-" if code is None else ("pass" if code == 0 else f"FAIL (exit {code})")
        result = "timed out" if code == 124 else result
        if code is None and c.kind == "cpu":
            result = "not reached"
        wall = "-" if code is None else (f"{seconds:.0f} s" if seconds else "(ran above)")
        command = c.text.replace("|", "\\|")
        kind = "cpu, fast" if c.fast else c.kind
        lines.append(f"| {c.file}:{c.line} | {kind} | `{command}` | {wall} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    commands = extract()
    if "--list" in argv:
        for c in commands:
            print(f"{c.kind:8s} {c.file}:{c.line}  {c.text}")
        return 0
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    table = Path(argv[argv.index("--markdown") + 1]) if "--markdown" in argv else None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    cwd, failed = _scratch(), 0
    print(f"scratch copy: {cwd} (commit {commit[:10]})", flush=True)
    results: dict[int, tuple[int, float]] = {}
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 3600.0
    done: dict[str, int] = {}  # a command written twice (a doc and its example): its code
    order = _in_run_order(commands)
    for i, c in enumerate(order):
        if c.kind != "cpu" or only not in f"{c.file} {c.text}":
            continue
        key = str((c.nproc, c.lmms_args)) if c.lmms_args is not None else c.text
        if key in done:  # ran already (`uv run` or not), in this scratch copy: its result stands
            results[i] = (done[key], 0.0)
            print(f"same     {c.file}:{c.line}  {c.text}", flush=True)
            continue
        code, seconds, tail = _run(c, cwd, timeout)
        results[i], done[key] = (code, seconds), code
        print(f"{'ok  ' if code == 0 else 'FAIL'} {seconds:7.1f}s {c.file}:{c.line}  {c.text}")
        if code != 0:
            failed += 1
            print("    " + tail.replace("\n", "\n    "), flush=True)
        if table is not None:  # as it goes
            table.write_text(_markdown(order, results, commit))
    if table is not None:
        table.write_text(_markdown(order, results, commit))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
