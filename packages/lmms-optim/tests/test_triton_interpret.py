"""The Triton kernels on CPU under TRITON_INTERPRET=1 (tiny odd shapes): CI exercises them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(here)}
    r = subprocess.run(
        [sys.executable, str(here / "optim_triton_checks.py"), "cpu"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "kernels 2x37x53 torch.bfloat16" in r.stdout
        and "ns 3x40x5" in r.stdout
        and "kernels 1x33x33 torch.float32" in r.stdout
    )
