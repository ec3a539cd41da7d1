"""benchmarks/train/bench_train.py's summary of the timed steps, on rows whose figures are known."""

import importlib.util
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "train"


@pytest.fixture(scope="module")
def bench_train():
    sys.path.insert(0, str(_DIR))  # the script imports trace_gaps from beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_train", _DIR / "bench_train.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(_DIR))


def _row(step, t, *, gc_s=0.0, graphs=4, fa4=10):
    return {
        "step": step, "step_time": t, "tokens": 16384, "mfu": 0.4 * 0.85 / t,
        "mfu_lm": 0.3 * 0.85 / t, "peak_memory_gb": 123.4, "data_wait_fraction": 0.0,
        "data_read_fraction": 0.02, "packing_fill_ratio": 1.0, "perf/gc_s": gc_s,
        "compile/graphs": graphs, "compile/fa4_variants": fa4,
    }  # fmt: skip


def test_a_slow_step_is_kept_in_the_mean_and_left_out_of_steady(bench_train):
    rows = [_row(s, 0.85) for s in range(5, 13)] + [_row(13, 6.0, gc_s=5.1, fa4=12)]
    rows += [_row(s, 0.85, fa4=12) for s in range(14, 25)]
    out = bench_train.summarize(rows)
    assert out["steps"] == 20 and out["step_s"] == pytest.approx((19 * 0.85 + 6.0) / 20, abs=1e-3)
    assert out["tok_s"] == round(20 * 16384 / (19 * 0.85 + 6.0))
    # MFU weighted by step time: the slow step counts for its time, not as one of 20
    assert out["mfu"] == pytest.approx(20 * 0.4 * 0.85 / (19 * 0.85 + 6.0), abs=1e-4)
    assert out["slow_steps"] == {13: {"s": 6.0, "gc_s": 5.1, "graphs": 4, "fa4_variants": 12}}
    assert out["gc_s_max"] == 5.1 and out["graphs"] == [4] and out["fa4_variants"] == [10, 12]
    steady = out["steady"]
    assert steady["steps"] == 19 and steady["step_s"] == 0.85
    assert steady["tok_s"] == round(16384 / 0.85) and steady["mfu"] == pytest.approx(0.4)
    assert steady["mfu_lm"] == pytest.approx(0.3)


def test_no_slow_step_no_steady_figures(bench_train):
    rows = [_row(s, t) for s, t in zip(range(5, 25), [0.8, 0.9] * 10, strict=True)]
    out = bench_train.summarize(rows)
    assert out["slow_steps"] == {} and "steady" not in out
    assert out["step_s_median"] == 0.85 and out["step_s"] == 0.85


def test_both_mfu_conventions_and_the_mean_over_median(bench_train):
    rows = [{**_row(s, t), "mfu_causal_half": 0.3 * 0.85 / t, "mfu_all_rows": 0.45 * 0.85 / t}
            for s, t in zip(range(1, 31), [3.0] + [0.85] * 29, strict=True)]  # fmt: skip
    out = bench_train.summarize(rows)
    assert out["mfu_causal_half"] < out["mfu"] < out["mfu_all_rows"]
    assert out["mean_over_median"] == pytest.approx((3.0 + 29 * 0.85) / 30 / 0.85, abs=1e-4)
    assert out["steady"]["mfu_causal_half"] == pytest.approx(0.3)  # step 1 left out of steady
