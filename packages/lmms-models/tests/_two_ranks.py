"""The session's one 2-rank spawn (conftest's `two_ranks`): every worker the selected test modules
name (``TWO_RANK_WORKER = "module:function"``, called as ``function(rank, world)``) runs in the
same two processes, one after the other, so torch, transformers and lmms are imported once."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from lmms_parallel.testing import run_cases


def _call(target: str, rank: int, world: int) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(rank, world)


def run(rank: int, world: int, targets: list[str]) -> dict[str, Any]:
    return run_cases((t, functools.partial(_call, t, rank, world)) for t in targets)
