"""The `lmms-train` command line.

    lmms-train CONFIG.yaml [section.key=value ...]      train (also: config_yaml=CONFIG.yaml)
    torchrun --nproc_per_node=N -m lmms_train CONFIG.yaml [...]
    lmms-train plan CONFIG.yaml [--gpus N] [--gpu-mem GiB] peak GPU memory per part, before launch; the layout that fits
    lmms-train plot RUN_DIR [--out FILE.png]            loss / MFU / throughput curves
    lmms-train docs                                     print the config reference (docs/config.md)
    lmms-train render CHECKPOINT_DIR --out F.png|.gif   diffusion checkpoints: ODE samples (SiT grid, Wan clips)
    lmms-train precompute CONFIG.yaml --out DIR         diffusion data: VAE latents + text embeddings to Parquet
    lmms-train check-data CONFIG.yaml [--num-records N] the data path over N records: speed, tokens, media, bad records, a sample
    lmms-train convert-config ENGINE.yaml [-o OUT.yaml] rewrite an lmms-engine config (docs/migrating-from-lmms-engine.md)
    lmms-train sample CKPT_DIR --prompt TEXT [...]      decode from a masked-diffusion checkpoint (docs/diffusion-lm.md)
    lmms-train --version                                versions of lmms packages, torch, transformers
    lmms-train launch [TORCHRUN OPTIONS] CONFIG.yaml   torchrun keeping the exit codes 2 / 75 / 130 (docs/failures.md)
    lmms-train COMMAND --help                           the usage of one command above
    --debug (anywhere)                                  show the traceback of user errors too

Exit codes (docs/failures.md): 0 finished; 2 a problem with the user's input (config, data, file
system), shown as one `lmms-train: error: ...` line per problem; 75 stopped by SIGTERM after saving
a checkpoint (requeue the job: `resume_from: auto` continues it); 130 Ctrl-C; 1 a bug in lmms (with
its traceback). `--debug` (or `LMMS_TRAIN_DEBUG=1`) shows the traceback of user errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from lmms_train._errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    ConfigError,
    UserError,
    os_error_message,
)

__all__ = ["main"]

_USAGE = __doc__.split("\n\n")[1]


def _fail(message: str, code: int = EXIT_USER_ERROR) -> int:
    """Print `message` as `lmms-train: error:` lines (one per line of it) and return `code`."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    lines = message.splitlines() or [""]
    print(f"lmms-train: error: {prefix}{lines[0]}", file=sys.stderr, flush=True)
    for line in lines[1:]:
        print(f"lmms-train: error: {prefix}{line}" if line.strip() else "", file=sys.stderr)
    return code


def _split_args(argv: Sequence[str]) -> tuple[str, list[str]]:
    config, overrides = None, []
    for arg in argv:
        if arg.startswith("config_yaml="):
            config = arg.split("=", 1)[1]
        elif "=" in arg or config is not None:
            overrides.append(arg)
        else:
            config = arg
    if not config:
        raise UserError(
            "no config file given: lmms-train CONFIG.yaml [section.key=value ...] (see --help)"
        )
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(f"unexpected argument {bad[0]!r}: overrides look like section.key=value")
    return config, overrides


PLOT_USAGE = "usage: lmms-train plot RUN_DIR [--out FILE.png]"


def _config_problems(cfg: Any) -> list[str]:
    from lmms_train._preflight import config_problems  # imports torch and the model code

    return config_problems(cfg)


def _subcommand_names() -> list[str]:
    from lmms_train._subcommands import SUBCOMMANDS

    return ["plot", "docs", *SUBCOMMANDS]


def _subcommand_help(name: str) -> str:
    """`lmms-train NAME --help`: its usage line(s), then what it does (this module's table)."""
    from lmms_train._subcommands import SUBCOMMANDS, USAGES

    usages = {"plot": PLOT_USAGE, "docs": "usage: lmms-train docs", **USAGES}
    usage = usages.get(name) or (SUBCOMMANDS[name].__doc__ or "").strip()
    what = [ln.strip() for ln in _USAGE.splitlines() if ln.split()[:2] == ["lmms-train", name]]
    return "\n".join([usage, *what])


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0 if argv else 2
    if len(argv) > 1 and set(argv[1:]) & {"-h", "--help"} and argv[0] in _subcommand_names():
        print(_subcommand_help(argv[0]))
        return 0
    if argv[0] == "plot":
        from lmms_train._plot import plot_run

        args = argv[1:]
        out = None
        if "--out" in args:
            i = args.index("--out")
            out = args[i + 1] if i + 1 < len(args) else None
            args = args[:i] + args[i + 2 :]
        if len(args) != 1:
            raise UserError(PLOT_USAGE)
        print(plot_run(args[0], out))
        return 0
    if argv[0] == "docs":
        from lmms_train.config import render_config_docs

        sys.stdout.write(render_config_docs())
        return 0
    from lmms_train._subcommands import SUBCOMMANDS

    if argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    config_path, overrides = _split_args(argv)
    from lmms_train.config import load_config

    shown: list[str] = []  # the config's own problems, shown before the checks' heavy imports

    def early(problems: list[str]) -> None:
        for problem in problems:
            _fail(problem)
        shown.extend(problems)

    try:
        cfg = load_config(config_path, overrides, checks=_config_problems, early=early)
    except ConfigError as exc:
        if not shown:
            raise
        for problem in exc.problems:
            if problem not in shown:
                _fail(problem)
        n = len(exc.problems)
        return _fail(f"{n} problems in the configuration (above)") if n > 1 else EXIT_USER_ERROR
    from lmms_train._trainer import run_training

    outcome = run_training(cfg)
    return EXIT_STOPPED if outcome.stopped else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lmms-train` script; returns (and exits with) the status code. Under
    `lmms-train launch` each worker also records its code for the launcher (`_launch`)."""
    from lmms_train._launch import recording_exit

    with recording_exit() as outcome:
        outcome.code = _main(argv)
    return outcome.code


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("LMMS_TRAIN_DEBUG") == "1" or "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        code = _run(argv)
    except UserError as exc:
        if debug:
            raise
        many = isinstance(exc, ConfigError) and len(exc.problems) > 1
        head = f"{len(exc.problems)} problems in the configuration:\n" if many else ""
        code = _fail(head + str(exc))
    except OSError as exc:  # disk full, no permission, read-only: the machine, not lmms
        message = os_error_message(exc)
        if message is None or debug:
            raise
        code = _fail(message)
    except KeyboardInterrupt:
        code = _fail("interrupted (Ctrl-C): stopped without saving", EXIT_INTERRUPTED)
    return code
