import subprocess
import sys


def test_import_is_light_and_public_api_complete():
    code = (
        "import sys, lmms_kernels as lk;"
        "heavy = [m for m in ('transformers', 'liger_kernel', 'flash_attn', 'triton') if m in sys.modules];"
        "assert not heavy, heavy;"
        "missing = [n for n in lk.__all__ if not hasattr(lk, n)];"
        "assert not missing, missing;"
        "print(sorted(lk.__all__))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "varlen_attention" in res.stdout and "apply_liger" in res.stdout
