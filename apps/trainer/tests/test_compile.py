"""`trainer_args.compile`: a tiny Qwen2.5-VL run with every decoder and vision block compiled
(after activation checkpointing, under FSDP2 on one CPU process) trains like the eager run.

The compiled run also carries issue 29's levers against the eager run without them: the compile
warm-up (`compile_warmup`, default on: no step compiles a graph, `compile/new_graphs` 0 from step
1 on, over packs of varying length), GC control (`gc_control`, default on: no automatic full
collection after step 1) and the LM head on labelled rows (`loss_rows: labelled`: same losses,
`mfu` counts the head on the rows run, `mfu_all_rows` on every row; the kernel tests check the
rows against every row to fp32 order on their own).

Inductor's CPU code generation takes minutes for these graphs on a 2-core machine, so the run
uses dynamo + AOTAutograd without Inductor (`LMMS_TRAIN_COMPILE_BACKEND=aot_eager`): the same
tracing, graph capture and custom-op backward as the real option.
"""

from __future__ import annotations

import json

import pytest
import torch

from lmms_train import train
from lmms_train._model_setup import COMPILE_BACKEND_ENV
from lmms_train.config import config_from_dict


def _cfg(tmp_path, out: str, **trainer):
    return config_from_dict({
        "model_config": {
            "load_from_config": {"model_type": "qwen2_5_vl", "tiny": True,
                                 "config": {"vision_config": {"patch_size": 14, "window_size": 112}}},
            "processor_path": str(tmp_path / "processor"),
            "build_local_processor": True,
        },
        "dataset_config": {
            "dataset_path": str(tmp_path / "data"),
            "generate_synthetic": {"num_samples": 32, "format": "parquet", "seed": 0},
            "packing": True, "packing_length": 384, "num_workers": 0, "max_pixels": 12544,
        },
        "trainer_args": {
            "output_dir": str(tmp_path / out), "max_steps": 3, "learning_rate": 5e-3,
            "bf16": False, "eval_steps": 0, "save_final": False, "report_to": [], "seed": 0,
            "activation_checkpointing": "full",
            **trainer,
        },
    })  # fmt: skip


def _losses(tmp_path, out: str) -> list[float]:
    lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if '"loss"' in x]


@pytest.mark.slow  # ~55 s on 2 cores: dynamo + AOTAutograd tracing of three block graphs
def test_compiled_blocks_train_like_eager(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    train(_cfg(tmp_path, "eager", loss_rows="all", gc_control=False))
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    train(_cfg(tmp_path, "compiled", compile=True, loss_rows="labelled"))
    eager, compiled = _losses(tmp_path, "eager"), _losses(tmp_path, "compiled")
    assert len(eager) == len(compiled) == 3
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert counters["stats"]["unique_graphs"] > 0  # the blocks really ran compiled
    rows = [
        json.loads(x) for x in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "loss" in r]
    graphs = [r["compile/graphs"] for r in rows]
    assert graphs[-1] == counters["stats"]["unique_graphs"] and graphs[0] > 0, graphs
    assert len({r["tokens"] for r in rows}) > 1  # packs of varying length
    assert [r["compile/new_graphs"] for r in rows] == [0, 0, 0]  # the warm-up compiled them all
    assert all(r["perf/gc_full"] == 0 for r in rows[1:])  # no automatic full collection
    plain = [json.loads(x) for x in (tmp_path / "eager" / "metrics.jsonl").read_text().splitlines()]
    plain = [r for r in plain if "loss" in r]
    for a, b in zip(plain, rows, strict=True):  # the head's FLOPs as run, and on every row
        assert b["mfu"] < b["mfu_all_rows"] and "mfu_all_rows" not in a
        assert b["mfu_all_rows"] * b["step_time"] == pytest.approx(a["mfu"] * a["step_time"])
        assert a["mfu_causal_half"] < a["mfu"] and b["mfu_causal_half"] < b["mfu"]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
