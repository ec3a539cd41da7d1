"""Logs a person reads: number formats, elapsed/ETA in plain console lines, the end summary, and
lr / grad-norm in the plot."""

from __future__ import annotations

import json

from lmms_train._banner import duration, end_summary, human
from lmms_train._metrics import ConsoleSink
from lmms_train._plot import plot_run


def test_number_and_time_formats():
    assert [human(x) for x in (12, 0.5, 1234, 1_234_567, 3.2e9, 12_345.0)] == [
        "12", "0.5", "1.23k", "1.23M", "3.2B", "12.3k"
    ]  # fmt: skip
    assert [duration(s) for s in (12.34, 185, 3725, float("nan"))] == [
        "12.3s",
        "3m05s",
        "1h02m",
        "?",
    ]


def test_plain_console_lines_have_readable_values_and_eta(capsys):
    sink = ConsoleSink(total=10, initial=2)  # resumed at step 2: the ETA uses this run's pace
    sink.started -= 8.0  # 8 s for the 4 steps 3..6
    sink.log(6, {"loss": 2.345678, "lr": 2e-5, "grad_norm": 1.23456, "tokens_per_sec": 12345.6,
                 "mfu": 0.3691})  # fmt: skip
    line = capsys.readouterr().err.strip()
    assert line.startswith("[lmms-train] step 6/10 loss=2.3457 lr=2.00e-05 grad_norm=1.23")
    assert "tok/s=12.3k" in line and "mfu=36.9%" in line
    assert "elapsed 8.0s eta 8.0s" in line  # 2 s per step, 4 steps to go


def test_epochs_run_counts_its_eta_down_to_the_first_pass_estimate(capsys, monkeypatch):
    """`max_steps: -1` with 3 passes: no ETA until the first pass ends (step 4 here), then
    3 x 4 = 12 steps are the run's length, on the plain lines and on the progress bar."""
    sink = ConsoleSink(total=-1, passes=3)
    sink.started -= 4.0  # 1 s a step
    for step in range(1, 4):
        sink.log(step, {"loss": 1.0, "data_passes": 0})
    before = capsys.readouterr().err
    assert "step 3 loss" in before and "eta" not in before
    sink.log(4, {"loss": 1.0, "data_passes": 1})
    sink.log(5, {"loss": 1.0, "data_passes": 1})
    after = capsys.readouterr().err.splitlines()
    assert "the first pass over the data took 4 steps: about 12 steps for 3 pass(es)" in after[0]
    assert after[1].startswith("[lmms-train] step 4/12 ") and " eta " in after[1]
    assert after[2].startswith("[lmms-train] step 5/12 ")

    from tqdm import tqdm

    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    bar_sink = ConsoleSink(total=-1, passes=2)
    assert isinstance(bar_sink._bar, tqdm) and bar_sink._bar.total is None  # no length yet
    bar_sink.log(5, {"loss": 1.0, "data_passes": 1})
    assert bar_sink._bar.total == 10
    bar_sink.close()


def test_end_summary_says_where_things_are(tmp_path):
    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)
    (tmp_path / "metrics.png").write_bytes(b"png")
    line = end_summary(out=tmp_path, steps=10, max_steps=10, tokens=1_234_567, seconds=125.0,
                       metrics={"loss": 1.23456}, stopped=False, exported=True,
                       checkpoint=tmp_path / "checkpoints" / "step_000010")  # fmt: skip
    assert "\n" not in line
    assert "done: 10/10 steps, 1.23M tokens in 2m05s (9.88k tokens/s), final loss 1.2346" in line
    for written in ("metrics.jsonl", "step_000010", "hf", "metrics.png"):
        assert written in line


def test_plot_has_lr_and_grad_norm(tmp_path, monkeypatch):
    rows = [{"step": i, "loss": 3.0 / i, "lr": 1e-3 * i, "grad_norm": 1.0 + i, "mfu": 0.1,
             "tokens_per_sec": 1e3} for i in range(1, 6)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import matplotlib.axes

    plotted: list[str] = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **kw: plotted.append(kw.get("label")) or real(self, *a, **kw))  # fmt: skip
    out = plot_run(tmp_path)
    assert out.stat().st_size > 1000
    assert {"loss", "lr", "grad_norm", "mfu", "tokens_per_sec"} <= set(plotted)
