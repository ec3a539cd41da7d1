"""The Triton kernels on CPU under TRITON_INTERPRET=1 (tiny odd shapes): CI exercises them."""

import pytest
from optim_scripts import run_script


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    r = run_script("optim_triton_checks.py", "cpu")
    assert (
        "kernels 2x37x53 torch.bfloat16" in r.stdout
        and "ns 3x40x5" in r.stdout
        and "kernels 1x33x33 torch.float32" in r.stdout
    )
