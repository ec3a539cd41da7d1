"""Issue 29's levers in the trainer (CPU): GC control, and bf16 optimizer state through a
save and resume on a tiny Qwen2 text run. The compile warm-up, the LM head on labelled rows and
GC control in a compiled run are checked in `test_compile.py` (one dynamo-traced run for all).
"""

from __future__ import annotations

import gc

import pytest

from lmms_train import train
from lmms_train._gc_clock import GcClock, GcControl
from lmms_train.config import config_from_dict


def test_gc_control_stops_automatic_collections():
    """Cyclic garbage that makes Python collect on its own (checked first, so the test can fail)
    starts no collection of any generation under GcControl, so no full one; its safe points
    collect (young generations each step, a full one every `full_every`)."""

    class Node:
        def __init__(self):
            self.me = self  # a reference cycle: only the cyclic collector frees it

    def churn(n: int = 100_000) -> None:
        for _ in range(n):
            Node()

    started: list[int] = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    clock = GcClock()
    try:
        churn()
        assert started, "Python's own thresholds should have collected"
        control = GcControl(True, full_every=2, clock=clock)
        try:
            control.after_warmup()
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            clock.take()
            started.clear()
            churn()
            assert started == [] and clock.take()["perf/gc_full"] == 0  # nothing automatic
            control.safe_point(1)  # young generations
            control.safe_point(2)  # every 2 steps: a full one, of the unfrozen objects
            assert started == [1, 2]
            got = clock.take()
            assert got["perf/gc_full"] == 0 and got["perf/gc_controlled"] == 1
        finally:
            control.close()
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        clock.close()
        gc.callbacks.remove(count)


@pytest.mark.slow  # ~15 s on an idle 2-core machine: three tiny runs
def test_bf16_optimizer_state_trains_and_resumes_exactly(text_config, logged_steps):
    """`optimizer_state_dtype: bfloat16` (lmms_optim.LowPrecisionAdamW): a run saved at step 2
    and resumed to step 4 logs the uninterrupted run's losses bit for bit (the stochastic
    rounding's draws are seeded by the step, kept in the checkpoint)."""

    def cfg(out: str, **trainer):
        kw = dict(optimizer_state_dtype="bfloat16", lr_scheduler_type="constant",
                  weight_decay=0.1, save_final=False)  # fmt: skip
        return config_from_dict(text_config(out, **{**kw, **trainer}))

    train(cfg("ref", max_steps=4))
    train(cfg("run", max_steps=2, save_final=True))
    train(cfg("run", max_steps=4, resume_from="latest"))
    ref, run = logged_steps("ref"), logged_steps("run")
    assert [r["step"] for r in run] == [1, 2, 3, 4]
    assert [r["loss"] for r in run] == [r["loss"] for r in ref]
    assert ref[-1]["loss"] < ref[0]["loss"]
    with pytest.raises(ValueError, match="Muon keeps fp32 state"):
        train(cfg("muon", optimizer="muon", optimizer_state_dtype="bfloat16"))
