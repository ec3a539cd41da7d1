"""Test setup for lmms-models: single-threaded torch (2 shared cores)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)
