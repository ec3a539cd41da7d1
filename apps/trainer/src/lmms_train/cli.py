"""The `lmms-train` command line.

    lmms-train CONFIG.yaml [section.key=value ...]      train (also: config_yaml=CONFIG.yaml)
    torchrun --nproc_per_node=N -m lmms_train CONFIG.yaml [...]
    lmms-train plot RUN_DIR [--out FILE.png]            loss / MFU / throughput curves
    lmms-train docs                                     print the config reference (docs/config.md)
    lmms-train check-data CONFIG.yaml [--num-records N] the data path over N records: speed, tokens, media, bad records, a sample
    lmms-train convert-config ENGINE.yaml [-o OUT.yaml] rewrite an lmms-engine config (docs/migrating-from-lmms-engine.md)
    lmms-train --version                                versions of lmms packages, torch, transformers

Problems with the user's input end with one line on stderr and exit code 2; set
`LMMS_TRAIN_DEBUG=1` to see the traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from lmms_train._errors import UserError

__all__ = ["main"]

_USAGE = __doc__.split("\n\n")[1]


def _fail(message: str) -> int:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    print(f"lmms-train: error: {prefix}{message}", file=sys.stderr, flush=True)
    return 2


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
        raise UserError("no config file given\n" + _USAGE)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(f"unexpected argument {bad[0]!r}: overrides look like section.key=value")
    return config, overrides


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "plot":
        from lmms_train._plot import plot_run

        args = argv[1:]
        out = None
        if "--out" in args:
            i = args.index("--out")
            out = args[i + 1] if i + 1 < len(args) else None
            args = args[:i] + args[i + 2 :]
        if len(args) != 1:
            raise UserError("usage: lmms-train plot RUN_DIR [--out FILE.png]")
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

    cfg = load_config(config_path, overrides)
    from lmms_train._trainer import train

    train(cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lmms-train` script; returns (and exits with) the status code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("LMMS_TRAIN_DEBUG") == "1"
    try:
        code = _run(argv)
    except UserError as exc:
        if debug:
            raise
        code = _fail(str(exc))
    except KeyboardInterrupt:
        code = _fail("interrupted")
    return code
