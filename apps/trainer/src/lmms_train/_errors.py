"""User-facing errors and the exit codes of `lmms-train` (docs/failures.md).

A `UserError` is a problem the user can fix (config, data, file system, launch): the CLI prints
its message as one `lmms-train: error: ...` line and exits with `EXIT_USER_ERROR`. Anything else
that escapes is a bug in lmms and exits 1 with its traceback.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable, Sequence

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STOPPED",
    "EXIT_USER_ERROR",
    "ConfigError",
    "DataChangedError",
    "DivergenceError",
    "UserError",
    "os_error_message",
    "suggest",
]

EXIT_OK = 0  # finished: max_steps reached (and the final checkpoint written if configured)
EXIT_INTERNAL = 1  # a bug in lmms: the traceback is printed
EXIT_USER_ERROR = 2  # a problem with the user's input: one line naming what to fix
EXIT_STOPPED = 75  # stopped by SIGTERM after saving a checkpoint: requeue (sysexits EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): stopped at once, nothing saved (128 + SIGINT)


class UserError(Exception):
    """A problem with the user's input (config, data, launch); shown as one clear message."""


class ConfigError(UserError, ValueError):
    """An invalid configuration: unknown key, bad value or an unsupported combination.

    `problems` holds every problem found in one pass (one line each); the message joins them.
    """

    def __init__(self, message: str | Sequence[str]) -> None:
        problems = [message] if isinstance(message, str) else list(message)
        self.problems = problems
        super().__init__("\n".join(problems))


class DivergenceError(UserError):
    """The loss or gradient norm became non-finite: the run stopped before saving bad weights."""


class DataChangedError(UserError):
    """The dataset files differ from those recorded in the checkpoint being resumed."""


def suggest(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def os_error_message(exc: OSError) -> str | None:
    """One line for an OSError the user's machine caused (disk full, no permission, read-only
    file system), or None for any other OSError (left to surface as a bug)."""
    where = exc.filename or "a file"
    if exc.errno in _FULL:
        return f"no space left on the device while writing {where} (free some space or use another folder)"
    if exc.errno == errno.EROFS:
        return f"read-only file system while writing {where}: this process cannot write there"
    if exc.errno in _DENIED:
        return f"permission denied for {where}: this process may not write (or read) there"
    return None
