"""Workspace-wide pytest configuration: the whole suite runs on two workers, and GPU tests are
skipped where no CUDA device exists (CI)."""

import os

import pytest

# The whole suite (`pytest` with no path: the README's command, CI's) runs on this many
# pytest-xdist workers, one test file per worker at a time (`--dist loadfile` in pyproject.toml:
# a file's module fixtures are built once). Two is what CI's 2 cores run well: many tests start
# 2-4 gloo ranks of their own, and the rest spend most of their time in one Python thread.
SUITE_WORKERS = 2


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): SUITE_WORKERS for the whole suite on a machine with
    that many cores; a run given paths or test ids runs in one process, as does a 1-core machine.
    An explicit `-n N` on the command line wins (`-n 0`: no workers)."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(SUITE_WORKERS, cores or 1)
    return workers if whole_suite and workers > 1 else 0


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
