"""`dataset_config.vision_balance_window` through lmms-train (issue 28, point 4): the loader
orders packs by the family's `pack_vision_flops` (installed once the model config is known) and a
run resumed mid-way gives the losses of the straight run (the balancer's window is part of the
data state)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from e2e_helpers import REPO, write_config


def _run(tmp_path: Path, name: str, *overrides: str) -> dict[int, float]:
    from lmms_train.cli import main

    cfg = yaml.safe_load((REPO / "examples/qwen2_5_vl/tiny_cpu_muon.yaml").read_text())
    cfg["model_config"]["processor_path"] = str(tmp_path / "processor")
    d = cfg["dataset_config"]
    d.update(dataset_path=str(tmp_path / "data"), packing_length=256, vision_balance_window=3,
             generate_synthetic={"num_samples": 48})  # fmt: skip
    cfg["trainer_args"].update(output_dir=str(tmp_path / name), eval_steps=0, report_to=[],
                               export_hf=False)  # fmt: skip
    assert main([str(write_config(cfg, tmp_path / f"{name}.yaml")), *overrides]) == 0
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_balanced_packs_resume_exactly(tmp_path: Path, monkeypatch) -> None:
    from lmms_data._loader import PackedLoader

    installed = []  # what the trainer hands the loader once the model config is known
    real = PackedLoader.set_vision_cost
    monkeypatch.setattr(PackedLoader, "set_vision_cost",
                        lambda self, cost: installed.append(cost) or real(self, cost))  # fmt: skip
    straight = _run(tmp_path, "straight", "trainer_args.max_steps=4", "trainer_args.save_steps=0")
    assert [c.func.__name__ for c in installed] == ["pack_vision_flops"], installed
    _run(tmp_path, "resumed", "trainer_args.max_steps=2", "trainer_args.save_steps=2")
    resumed = _run(tmp_path, "resumed", "trainer_args.max_steps=4",
                   "trainer_args.resume_from=latest")  # fmt: skip
    assert [straight[s] for s in (3, 4)] == [resumed[s] for s in (3, 4)]
    from lmms_data import build_dataloader

    loader = build_dataloader({"dataset_path": str(tmp_path / "data"), "num_workers": 0,
                               "processor_family": "qwen2_5_vl", "packing_length": 256,
                               "vision_balance_window": 3}, str(tmp_path / "processor"))  # fmt: skip
    calls: list[float] = []
    loader.set_vision_cost(lambda b: calls.append(1.0) or 0.0)
    next(iter(loader))
    assert calls  # the installed cost is what the window orders by
