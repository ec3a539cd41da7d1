"""Command-line helpers shared by the `lmms-train` subcommands."""

from __future__ import annotations

from lmms_train._errors import UserError

__all__ = ["take_option"]


def take_option(args: list[str], name: str, usage: str) -> tuple[list[str], str | None]:
    """`args` without `name VALUE`, and VALUE (None if `name` is absent); a `name` with no value
    after it is a `UserError` showing `usage`."""
    if name not in args:
        return args, None
    i = args.index(name)
    if i + 1 >= len(args):
        raise UserError(usage)
    return args[:i] + args[i + 2 :], args[i + 1]
