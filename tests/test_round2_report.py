"""benchmarks/train/round2_report.py: issue 29's verdicts from tagged bench_train rows."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "train" / "round2_report.py"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("round2_report", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(case, mfu=0.5, **kw):
    return {"case": case, "status": "ok", "tok_s": 1, "mfu": mfu, "mfu_lm": mfu * 0.8,
            "mfu_causal_half": mfu * 0.9, "steps": 21, "step_s_median": 1.0,
            "mean_over_median": 1.0, **kw}  # fmt: skip


def test_verdicts_read_the_after_rows_and_name_their_baselines(report, tmp_path):
    rows = [_row("vl3b_16k-before", 0.48), _row("vl3b_16k-after", 0.56, mfu_lm=0.45),
            _row("text3b_16k-after", 0.60), {"case": "vl7b_16k_fp32state-after", "status": "OOM"},
            _row("vl7b_16k-after", 0.41),
            _row("vl3b_16k-coldbefore", steps=30, mean_over_median=1.25),
            _row("vl3b_16k-coldafter", steps=30, mean_over_median=1.02)]  # fmt: skip
    rows += [
        _row(f"vl3b_32k-adamw{i}", step_s_median=s) for i, s in ((1, 1.8), (2, 1.82), (3, 1.79))
    ]
    rows += [
        _row(f"vl3b_32k_muon-muon{i}", step_s_median=s)
        for i, s in ((1, 1.97), (2, 1.97), (3, 2.05))
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rows))
    got = {(v[0], v[1]): v for v in report.verdicts(report.load([path]))}
    assert got[("vl3b_16k", "mfu >= 55%")][3] == "met"
    assert "before, same run: 48.0%" in got[("vl3b_16k", "mfu >= 55%")][2]
    assert got[("vl3b_16k", "mfu_lm >= 44%")][3] == "met"
    assert got[("text3b_16k", "mfu >= 62%")][3] == "not met"
    assert got[("text1p5b_16k", "mfu >= 58%")][2] == "not measured"
    assert (
        got[("vl7b_16k", "mfu >= 40%")][3] == "met" and "OOM" in got[("vl7b_16k", "mfu >= 40%")][2]
    )
    muon = got[("vl3b_32k", "Muon within 10% of AdamW (median of 3)")]
    assert muon[3] == "met" and "+9.4%" in muon[2] and "spread 0.080" in muon[2]
    cold = got[("vl3b_16k cold", "30-step mean within 3% of steady")]
    assert cold[3] == "met" and "+25.0%" in cold[2]
