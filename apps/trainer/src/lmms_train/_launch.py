"""`lmms-train launch`: torchrun with lmms-train's exit codes kept (docs/failures.md).

torchrun reports any failed worker as its own exit 1 with a traceback of its own, so a scheduler
cannot tell a config error (2) or a preemption that saved a checkpoint (75) from a bug. This
wrapper runs ``python -m torch.distributed.run [TORCHRUN OPTIONS] -m lmms_train CONFIG [...]``
with ``LMMS_TRAIN_EXIT_DIR`` set: every worker writes its pid when it starts and its exit code
when it ends (`recording_exit`, around `lmms_train.cli.main`), and the wrapper exits with the
workers' code:

* every worker 0: 0;
* otherwise the most serious code a worker wrote: 1 (a bug, or any unknown code) > 2 (the
  user's input) > 130 (Ctrl-C) > 75 (stopped by SIGTERM after saving); workers killed by
  torchrun after a peer failed write nothing and are not counted;
* no worker wrote a code (torchrun itself failed, e.g. a bad option): torchrun's code.

SIGTERM and SIGINT sent to the wrapper (a scheduler's preemption, Ctrl-C) are forwarded to the
workers directly, not through torchrun (which would SIGKILL workers still writing their
checkpoint after its `--shutdown_timeout`, 30 s by default); torchrun runs in its own session so
that a signal to the job's process group reaches the workers once, through the wrapper.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmms_train._errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    UserError,
)

__all__ = ["EXIT_DIR_VAR", "launch_exit_code", "launch_main", "recording_exit"]

EXIT_DIR_VAR = "LMMS_TRAIN_EXIT_DIR"
USAGE = (
    "usage: lmms-train launch [TORCHRUN OPTIONS] CONFIG.yaml [section.key=value ...]\n"
    "  e.g. lmms-train launch --nproc_per_node=8 run.yaml (torchrun's options before the "
    "config; docs/failures.md)"
)
# most serious first: what the wrapper reports when workers disagree
_PRECEDENCE = (EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_STOPPED)


@dataclass(kw_only=True, slots=True)
class Outcome:
    code: int = EXIT_INTERNAL  # what an exception escaping the block means (a bug)


def _rank_file(suffix: str) -> Path | None:
    folder = os.environ.get(EXIT_DIR_VAR)
    if not folder:
        return None
    return Path(folder) / f"rank{os.environ.get('RANK', '0')}.{suffix}"


@contextlib.contextmanager
def recording_exit() -> Iterator[Outcome]:
    """Under `lmms-train launch`: write this worker's pid now and its exit code at the end (1
    when an exception escapes: the traceback then ends the process). A no-op otherwise."""
    outcome = Outcome()
    pid_file = _rank_file("pid")
    if pid_file is not None:
        pid_file.write_text(str(os.getpid()))
    try:
        yield outcome
    finally:
        code_file = _rank_file("code")
        if code_file is not None:
            code_file.write_text(str(outcome.code))


def launch_exit_code(torchrun_code: int, worker_codes: dict[int, int]) -> int:
    """The wrapper's exit code from torchrun's and the codes the workers wrote (see module)."""
    if torchrun_code == 0 and all(c == EXIT_OK for c in worker_codes.values()):
        return EXIT_OK
    failed = {c for c in worker_codes.values() if c != EXIT_OK}
    if not failed:
        return torchrun_code or EXIT_INTERNAL
    if failed - set(_PRECEDENCE):
        return EXIT_INTERNAL
    return next(c for c in _PRECEDENCE if c in failed)


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, lmms-train's arguments): the config is the first argument that is
    neither an option nor the value of an option given as ``--name value``."""
    for i, arg in enumerate(args):
        if arg.startswith("-"):
            continue
        prev = args[i - 1] if i else ""
        if prev.startswith("-") and "=" not in prev and not arg.endswith((".yaml", ".yml")):
            continue  # the value of a torchrun option
        return args[:i], args[i:]
    raise UserError(USAGE)


def _read(folder: Path, suffix: str) -> dict[int, int]:
    out = {}
    for f in folder.glob(f"rank*.{suffix}"):
        with contextlib.suppress(ValueError, OSError):
            out[int(f.name[4 : -len(suffix) - 1])] = int(f.read_text())
    return out


def launch_main(args: list[str]) -> int:
    """Run torchrun on lmms-train and exit with the workers' code (see the module)."""
    torchrun_args, train_args = _split(args)
    with tempfile.TemporaryDirectory(prefix="lmms-train-launch-") as tmp:
        folder = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
               "-m", "lmms_train", *train_args]  # fmt: skip
        proc = subprocess.Popen(cmd, env={**os.environ, EXIT_DIR_VAR: tmp}, start_new_session=True)

        def forward(signum: int, frame: object) -> None:
            pids = _read(folder, "pid").values()
            for pid in pids or [proc.pid]:  # before the workers started: torchrun
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                try:
                    torchrun_code = proc.wait()
                    break
                except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded instead
                    continue
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        codes = _read(folder, "code")
    code = launch_exit_code(torchrun_code, codes)
    if code != torchrun_code:
        shown = ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items()))
        print(
            f"lmms-train launch: torchrun exited {torchrun_code}; the workers exited ({shown}): "
            f"exit {code}",
            file=sys.stderr,
            flush=True,
        )
    return code
