"""User-facing errors: the CLI prints their message and exits non-zero without a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "UserError", "suggest"]


class UserError(Exception):
    """A problem with the user's input (config, data, launch); shown as one clear message."""


class ConfigError(UserError, ValueError):
    """An invalid configuration: unknown key, bad value or an unsupported combination."""


def suggest(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
