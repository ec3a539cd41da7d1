"""`python -m lmms_pack.demo` runs and reports every strategy and an identical resume."""

from __future__ import annotations

from lmms_pack import STRATEGIES
from lmms_pack.demo import main


def test_demo_runs(capsys):
    main(["--n", "3000", "--capacity", "8000"])
    out = capsys.readouterr().out
    for strategy in STRATEGIES:
        assert f"\n{strategy} " in out
    assert "identical packs" in out and "cu_seqlens" in out
