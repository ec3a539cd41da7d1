"""A pytest plugin that records the figures behind every parity assertion (issue 35, point 6).

    PARITY_FIGURES_OUT=figs.json python -m pytest -p parity_figures TESTS   # scripts/ on PYTHONPATH

Wraps `torch.testing.assert_close` and `torch.equal` (before the tests import them): per test id,
the number of tensor comparisons, the largest absolute difference over all of them, whether every
`torch.equal` held, and the test's outcome. The comparisons themselves are unchanged (the wrapped
functions are called as before). scripts/behaviour_record.py's `parity` runs it at two commits.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

_FIGURES: dict[str, dict[str, Any]] = {}
_CURRENT: list[str] = [""]
_assert_close = torch.testing.assert_close
_equal = torch.equal


def _note(actual: Any, expected: Any) -> None:
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return
    if actual.shape != expected.shape or not actual.numel():
        return
    diff = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().max()
    fig = _FIGURES.setdefault(_CURRENT[0], {"comparisons": 0, "max_abs": 0.0, "all_equal": True})
    fig["comparisons"] += 1
    fig["max_abs"] = max(fig["max_abs"], float(diff))


def _wrapped_assert_close(actual: Any, expected: Any, *args: Any, **kwargs: Any) -> None:
    _note(actual, expected)
    _assert_close(actual, expected, *args, **kwargs)


def _wrapped_equal(a: Any, b: Any) -> bool:
    same = _equal(a, b)
    _note(a, b)
    fig = _FIGURES.get(_CURRENT[0])
    if fig is not None and not same:
        fig["all_equal"] = False
    return same


torch.testing.assert_close = _wrapped_assert_close
torch.equal = _wrapped_equal


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _CURRENT[0] = item.nodeid
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        fig = _FIGURES.setdefault(report.nodeid, {"comparisons": 0, "max_abs": 0.0,
                                                  "all_equal": True})  # fmt: skip
        fig["outcome"] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("PARITY_FIGURES_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(_FIGURES, f, indent=1, sort_keys=True)
