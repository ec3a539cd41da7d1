"""LR schedules, MFU arithmetic, JSONL resume truncation and the plot command."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from lmms_train._flops import mfu, peak_flops_for
from lmms_train._metrics import JsonlSink, read_jsonl
from lmms_train._plot import plot_run
from lmms_train._schedule import ScheduleConfig, build_scheduler, lr_multiplier


def test_schedules_shape():
    c = ScheduleConfig(kind="cosine", max_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    vals = [lr_multiplier(s, c) for s in range(10)]
    assert vals[0] == pytest.approx(0.5) and vals[1] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(vals[1:]))  # decays after warmup
    assert lr_multiplier(10, c) == pytest.approx(0.1)
    w = ScheduleConfig(kind="wsd", max_steps=10, wsd_decay_ratio=0.2, min_lr_ratio=0.0)
    assert [lr_multiplier(s, w) for s in range(10)] == pytest.approx([1] * 8 + [0.5, 0.0])
    lin = ScheduleConfig(kind="linear", max_steps=4)
    assert [lr_multiplier(s, lin) for s in range(4)] == pytest.approx([1, 0.75, 0.5, 0.25])
    assert lr_multiplier(3, ScheduleConfig(kind="constant", max_steps=4)) == 1.0


def test_scheduler_state_resumes():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    c = ScheduleConfig(kind="cosine", max_steps=6, warmup_steps=1)
    s = build_scheduler(opt, c)
    for _ in range(3):
        opt.step()
        s.step()
    state = s.state_dict()
    opt2 = torch.optim.SGD([p], lr=1.0)
    s2 = build_scheduler(opt2, c)
    s2.load_state_dict(state)
    assert s2.get_last_lr() == s.get_last_lr()


def test_mfu_arithmetic():
    assert mfu(989e12, 1.0, 1, 989e12) == pytest.approx(1.0)
    assert mfu(1e12, 2.0, 4, 1e12) == pytest.approx(0.125)
    assert peak_flops_for(torch.device("cpu"), 5e9) == 5e9


def test_jsonl_truncates_on_resume_and_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for s in range(1, 6):
        sink.log(
            s, {"loss": 1.0 / s, "mfu": 0.1, "tokens_per_sec": 100.0 * s, "lr": torch.tensor(0.5)}
        )
    sink.close()
    sink = JsonlSink(path, resume_step=3)
    sink.log(4, {"loss": 9.0})
    sink.close()
    recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["loss"] == 9.0
    assert recs[0]["lr"] == 0.5
    out = plot_run(tmp_path)
    assert out.is_file() and out.stat().st_size > 1000
    assert json.loads(path.read_text().splitlines()[0])["step"] == 1


def test_phase_timer_attributes_time_to_the_phase_each_mark_ends():
    import time

    import torch

    from lmms_train._step import PhaseTimer

    off = PhaseTimer(enabled=False, device=torch.device("cpu"))
    off.mark("start")
    off.mark("forward")
    assert off.read() == {}
    pt = PhaseTimer(enabled=True, device=torch.device("cpu"))
    pt.mark("start")
    time.sleep(0.02)
    pt.mark("forward")
    pt.mark("backward")
    time.sleep(0.01)
    pt.mark("forward")  # a second micro-batch adds to the same phase
    times = pt.read()
    assert set(times) == {"time/forward", "time/backward"}
    assert times["time/forward"] >= 0.03 - 1e-3
    assert times["time/backward"] < 0.01
    assert pt.read() == {}  # read() clears


def test_gc_clock_counts_collections_between_takes():
    import gc

    from lmms_train._gc_clock import GcClock

    clock = GcClock()
    enabled = gc.isenabled()
    gc.disable()  # only this test's collections
    try:
        clock.take()
        junk = [[i] for i in range(200_000)]  # tracked objects: a full collection walks them
        gc.collect()
        gc.collect(0)
        got = clock.take()
        assert got["perf/gc_full"] == 1.0 and got["perf/gc_s"] > 0.0
        assert clock.take() == {"perf/gc_s": 0.0, "perf/gc_full": 0.0, "perf/gc_controlled": 0.0}
        del junk
    finally:
        clock.close()
        if enabled:
            gc.enable()
    assert clock._callback not in gc.callbacks
    gc.collect()
    closed = {"perf/gc_s": 0.0, "perf/gc_full": 0.0, "perf/gc_controlled": 0.0}
    assert clock.take() == closed  # closed: nothing counted


def test_slow_steps_names_a_stall_and_its_likely_cause():
    from lmms_train._slow_steps import SlowSteps

    slow = SlowSteps(factor=3.0, window=20, warmup=3)
    row = {"step_time": 1.0, "compile/graphs": 4, "compile/fa4_variants": 10, "perf/gc_s": 0.0}
    assert slow.check(1, {**row, "step_time": 9.0}) is None  # no median yet: compile steps
    assert slow.check(2, row) is None
    assert slow.check(3, {**row, "compile/graphs": 5}) is None  # a rise in an ordinary step
    assert slow.check(4, {**row, "compile/graphs": 5}) is None
    msg = slow.check(5, {**row, "step_time": 6.0, "compile/graphs": 5, "compile/fa4_variants": 12})
    assert msg.startswith("step 5 took 6.00 s, 6.0x the median of the last 4 (1.00 s)")
    assert msg.endswith(": 2 new FA4 kernel(s)")  # the graphs rose before this step
    msg = slow.check(6, {**row, "step_time": 5.0, "compile/graphs": 6, "compile/fa4_variants": 12,
                         "perf/gc_s": 4.0})  # fmt: skip
    assert "1 new dynamo graph(s); 4.00 s in Python's garbage collector" in msg
    assert "median of the last 4" in msg  # the stalls stayed out of the median
    assert "no new graphs" in slow.check(7, {**row, "step_time": 4.0, "compile/graphs": 6,
                                             "compile/fa4_variants": 12})  # fmt: skip
    assert slow.check(8, {"step_time": 2.9}) is None  # under 3x: ordinary


def test_slow_steps_names_the_fa4_key_fields_a_stalled_step_switched(monkeypatch):
    """A stalled step whose FA4 count rose: the message says which of FA4's compile-key fields
    the new kernel has that the closest held one did not (what to compile ahead)."""
    import sys
    import types

    from lmms_train._slow_steps import SlowSteps

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_bwd = lambda: None
    cache = {("bf16", 80, False): 0, ("bf16", 128, False): 1}
    interface._flash_attn_bwd.compile_cache = cache
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    slow = SlowSteps(factor=3.0, window=20, warmup=3)
    for step in range(1, 5):
        slow.note_fa4(step, len(cache))
        assert slow.check(step, {"step_time": 1.0, "compile/fa4_variants": len(cache)}) is None
    cache[("bf16", 80, True)] = 2  # step 5 compiles the single-block variant of the first key
    slow.note_fa4(5, len(cache))
    msg = slow.check(5, {"step_time": 5.0, "compile/fa4_variants": len(cache)})
    assert msg.endswith("1 new FA4 kernel(s) (FA4 _flash_attn_bwd: new key, key[2]: False -> True)")
    cache[("bf16", 128, True)] = 3  # a rise in an ordinary step: kept quiet, then forgotten
    slow.note_fa4(6, len(cache))
    assert slow.check(6, {"step_time": 1.0, "compile/fa4_variants": len(cache)}) is None
    assert not slow._fa4_new
