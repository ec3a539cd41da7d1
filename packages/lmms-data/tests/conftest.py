"""Shared fixtures: a local processor folder per family, synthetic datasets, text-only records."""

from __future__ import annotations

import os
import sys

import pytest

import lmms_data as ld

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def proc25(tmp_path_factory) -> dict:
    return ld.build_local_processor(str(tmp_path_factory.mktemp("proc25")), "qwen2_5_vl")


@pytest.fixture(scope="session")
def proc3(tmp_path_factory) -> dict:
    return ld.build_local_processor(str(tmp_path_factory.mktemp("proc3")), "qwen3_vl")


@pytest.fixture(scope="session")
def syn_parquet(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("synpq"))
    ld.generate_synthetic_vl(d, 96, "parquet", seed=1, num_shards=2, rows_per_group=16)
    return d


@pytest.fixture(scope="session")
def syn_jsonl(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("synjs"))
    ld.generate_synthetic_vl(d, 40, "jsonl", seed=2)
    return d
