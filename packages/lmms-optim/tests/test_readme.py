"""The README's example runs and trains."""

import re
import subprocess
import sys
from pathlib import Path


def test_readme_example_trains():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 13
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split("loss")[-1]) < 1.0, r.stdout  # from ~4.6 (ln 100)
