"""benchmarks/train/issue8_report.py on files whose verdicts are known."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "train" / "issue8_report.py"
_spec = importlib.util.spec_from_file_location("issue8_report", _PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _lmms(case, tok_s, mfu, mfu_lm, step_s, *, each=None, syncs=0, wait=0.001):
    return {
        "case": case, "status": "ok", "tok_s": tok_s, "mfu": mfu, "mfu_lm": mfu_lm,
        "step_s": step_s, "peak_gib": 100.0, "data_wait": wait, "step_s_each": each or [step_s],
        "host_waits": {"sync": {"count": syncs, "ms": 0.0}},
    }  # fmt: skip


def _write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def _verdicts(lines):
    rows = [ln.split(" | ") for ln in lines[2:]]
    return {r[0].lstrip("| "): r[-1].rstrip(" |") for r in rows}


def test_verdicts_read_the_steady_figures_and_the_last_row_of_a_case(tmp_path):
    each = [0.85] * 19 + [6.0]  # one cold-cache step: the targets read the other 19
    mean = sum(each) / 20
    k = mean / 0.85
    first = _write(tmp_path, "a.json", [_lmms("vl3b_16k-master", 9000, 0.30, 0.24, 0.9)])
    second = _write(
        tmp_path, "b.json",
        [
            _lmms("vl3b_16k-fused", round(16384 / mean), 0.46 / k, 0.36 / k, mean, each=each),
            _lmms("vl3b_16k_muon-fused", 16000, 0.40, 0.31, 1.02),
            _lmms("text3b_16k-fused", 29000, 0.567, 0.567, 0.563),
            {"case": "text1p5b_16k", "status": "timeout"},
            {"case": "hf_sdpa-micro4k", "status": "ok", "tok_s": 1500, "mfu": 0.04,
             "mfu_lm": 0.03, "step_s": 10.0},
            {"case": "hf_sdpa_liger", "status": "ok", "tok_s": 2000, "mfu": 0.05,
             "mfu_lm": 0.04, "step_s": 8.0},
        ],
    )  # fmt: skip
    calib = tmp_path / "calib_vl.txt"
    calib.write_text('noise\nRESULT {"tok_s": 9000, "mfu_total": 0.24}\n')
    rows = report.load_rows([first, second])
    assert rows["vl3b_16k"]["row"] == "vl3b_16k-fused"  # the last one given
    assert rows["vl3b_16k"]["steady"]["steps"] == 19
    got = _verdicts(report.verdicts(rows, report.read_calibration(calib), None))
    assert got["vl3b_16k total MFU >= 45.0%"] == "met"  # 46% steady, ~30% with the slow step
    assert got["vl3b_16k LM-only MFU >= 33.0%"] == "met"
    assert got["text3b_16k total MFU >= 55.0%"] == "met"
    assert got["text1p5b_16k total MFU >= 45.0%"] == "not measured"  # timed out
    assert got["vl3b_16k >= 1.6x calibration"] == "met"  # 19,275 / 9,000
    assert got["vl3b_16k >= 10x plain transformers (hf_sdpa)"] == "met"  # 12.9x
    assert got["vl3b_16k >= 10x plain transformers (hf_sdpa_liger)"] == "not met"  # 9.6x
    assert got["Muon step within 10% of AdamW (vl3b_16k)"] == "not met"  # 1.02 / 0.85: +20%
    assert got["no host synchronisation in the profiled steps"] == "met"
    assert got["data wait < 2% of the step (every lmms row)"] == "met"


def test_a_sync_or_an_exposed_data_wait_fails_its_target(tmp_path):
    path = _write(
        tmp_path, "c.json",
        [_lmms("vl3b_16k", 19000, 0.48, 0.38, 0.86, syncs=1),
         _lmms("vl3b_16k_muon", 17000, 0.42, 0.33, 0.94, wait=0.03)],
    )  # fmt: skip
    got = _verdicts(report.verdicts(report.load_rows([path]), None, None))
    assert got["no host synchronisation in the profiled steps"] == "not met"
    assert got["data wait < 2% of the step (every lmms row)"] == "not met"
    assert got["Muon step within 10% of AdamW (vl3b_16k)"] == "met"  # +9.3%
    assert got["vl3b_16k >= 1.6x calibration"] == "not measured"


def test_gradient_accumulation_rows_are_cases_of_their_own(tmp_path):
    """A GA-4 row (four packs per optimizer step) never replaces the GA-1 case the targets
    name; Muon is compared with AdamW at every size and GA measured with both."""
    path = _write(
        tmp_path, "d.json",
        [_lmms("vl3b_16k-master", 19000, 0.48, 0.38, 0.855),
         _lmms("vl3b_16k_muon-master", 15300, 0.39, 0.30, 1.070),
         _lmms("vl3b_32k-master", 17900, 0.456, 0.353, 1.826),
         _lmms("vl3b_32k_muon-master", 16000, 0.407, 0.315, 2.046),
         _lmms("vl3b_16k-ga4", 18600, 0.47, 0.37, 3.515),
         {**_lmms("vl3b_16k_muon-x", 17900, 0.45, 0.35, 3.664), "ga": 4}],
    )  # fmt: skip
    rows = report.load_rows([path])
    assert rows["vl3b_16k"]["row"] == "vl3b_16k-master"
    assert rows["vl3b_16k@ga4"]["row"] == "vl3b_16k-ga4"
    assert rows["vl3b_16k_muon@ga4"]["row"] == "vl3b_16k_muon-x"  # from its "ga" field
    got = _verdicts(report.verdicts(rows, None, None))
    assert got["vl3b_16k total MFU >= 45.0%"] == "met"  # the GA-1 row: 48%
    assert got["Muon step within 10% of AdamW (vl3b_16k)"] == "not met"  # +25.1%
    assert got["Muon step within 10% of AdamW (vl3b_32k)"] == "not met"  # +12.0%
    assert got["Muon step within 10% of AdamW (vl3b_16k@ga4)"] == "met"  # +4.2%
