"""benchmarks/train/trace_gaps.py on a hand-built trace whose idle time is known."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "train" / "trace_gaps.py"
_spec = importlib.util.spec_from_file_location("trace_gaps", _PATH)
trace_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gaps)


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def _trace():
    frame = "/site/lmms_models/qwen2_5_vl.py(120): forward"
    return [
        # host: a model frame with two operators; the second launches late
        _x("python_function", frame, 0, 1000),
        _x("python_function", "/site/torch/nn/modules/module.py(1): _call_impl", 0, 1000),
        _x("cpu_op", "aten::mm", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 5, correlation=1),
        _x("cpu_op", "lmms_kernels::varlen_attn", 300, 400),
        _x("cuda_driver", "cuLaunchKernelEx", 650, 10, correlation=2),
        # launched early, started late: queued behind something the trace does not show
        _x("cuda_runtime", "cudaLaunchKernel", 700, 5, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 705, 5, correlation=4),
        # device: kernel 1 on two streams' worth of overlap, then the gaps
        _x("kernel", "gemm", 20, 100, tid=7, correlation=1),
        _x("gpu_memcpy", "Memcpy HtoD", 50, 100, tid=8),  # overlaps: busy 20-150
        _x("kernel", "fa4_fwd", 670, 30, tid=7, correlation=2),  # gap 150-670: host-bound
        _x("kernel", "add", 760, 10, tid=7, correlation=3),  # gap 700-760: queued
        _x("kernel", "mul", 775, 5, tid=7, correlation=4),  # gap of 5 us: below min_us
    ]


def test_idle_time_is_split_into_host_bound_and_queued_gaps(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [*_trace(), {"ph": "M", "name": "process_name"}]}, f)
    r = trace_gaps.analyze(trace_gaps.load(path), min_us=20)
    assert r["span_ms"] == pytest.approx(0.760)  # 20 .. 780 us
    assert r["busy_ms"] == pytest.approx(0.175)  # 130 + 30 + 10 + 5
    assert r["idle_ms"] == pytest.approx(0.585)
    assert r["gaps"] == 2 and r["small_gaps_ms"] == pytest.approx(0.005)
    assert r["host_bound_ms"] == pytest.approx(0.520)
    assert r["queued_ms"] == pytest.approx(0.060)
    assert r["by_op_ms"] == [("lmms_kernels::varlen_attn", 0.52)]
    assert r["by_frame_ms"] == [("lmms_models/qwen2_5_vl.py:forward", 0.52)]
    text = trace_gaps.format_report(r)
    assert "host-bound (launched after the device ran dry): 0.5 ms" in text


def test_a_trace_without_device_work_says_so():
    r = trace_gaps.analyze([_x("cpu_op", "aten::mm", 0, 10)])
    assert "no device events" in trace_gaps.format_report(r)
