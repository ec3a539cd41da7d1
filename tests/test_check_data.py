"""`lmms-train check-data` measures a run's data without its model; `convert-config` rewrites an
lmms-engine config; an lmms-engine config given to `lmms-train` directly is read the same way."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import yaml
from e2e_helpers import tiny_config, write_config
from PIL import Image

from lmms_train._check_data import check_data
from lmms_train._subcommands import check_data_main, convert_config_main
from lmms_train.config import config_from_dict


@pytest.fixture
def llava_dir(tmp_path):
    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 120, np.uint8)).save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())

    def rec(img: str, answer: str = "A grey square.") -> dict:
        return {"image": img, "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": answer}]}  # fmt: skip

    recs = [rec("a.png") for _ in range(6)]
    recs[2] = rec("missing.png")
    recs[4] = rec("a.png", "grey " * 300)  # longer than packing_length
    (tmp_path / "llava.json").write_text(json.dumps(recs, indent=2))
    return tmp_path


def test_check_data_reports_what_a_user_needs(tiny_inputs, llava_dir, tmp_path, capsys):
    cfg = tiny_config(tiny_inputs, tmp_path / "run")
    cfg["dataset_config"].update(dataset_path=str(llava_dir / "llava.json"), eval_dataset_path=None)
    r = check_data(config_from_dict(cfg), num_records=5)
    assert r.seen == 5 and r.good == 3  # the 6th record is not read
    assert r.bad == {"missing_media": 1, "too_long": 1}
    assert "missing.png" in r.examples["missing_media"]
    assert "> packing_length 384" in r.examples["too_long"]
    assert r.media["image"] == 3 and len(set(r.lengths)) == 1 and min(r.media_tokens) > 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_inputs["processor"])
    assert r.supervised[0] == len(tok("A grey square.<|im_end|>")["input_ids"])
    assert "<|image_pad|>x" in r.sample and "[[A grey square.<|im_end|>]]" in r.sample
    text = r.text()
    for needle in ("records/s", "3 good, 2 bad", "median", "supervised", "image 3 (1.00/record)",
                   "missing_media=1, too_long=1", "[[A grey square."):  # fmt: skip
        assert needle in text, needle
    assert r.total_records is None and "steps per epoch" not in text  # JSON: not counted
    parquet = check_data(config_from_dict(tiny_config(tiny_inputs, tmp_path / "r2")), 20)
    assert parquet.total_records == 96 and "96 records in the dataset" in parquet.text()
    # the command prints the same report
    path = write_config(cfg, tmp_path / "c.yaml")
    assert check_data_main([str(path), "--num-records", "5"]) == 0
    assert "3 good, 2 bad" in capsys.readouterr().out


def test_engine_config_converts_and_trains(tiny_inputs, llava_dir, tmp_path, capsys):
    """An lmms-engine-shaped config (inline data list, processor block, HF arguments) trains on a
    mixture of the Parquet data and a LLaVA JSON array."""
    from lmms_train import train
    from lmms_train.config import load_config

    recs = json.loads((llava_dir / "llava.json").read_text())
    clean = [r for r in recs if r["image"] == "a.png" and len(r["conversations"][1]["value"]) < 50]
    (llava_dir / "clean.json").write_text(json.dumps(clean * 4, indent=2))
    engine = {
        "trainer_type": "fsdp2_trainer",
        "dataset_config": {
            "dataset_type": "vision", "dataset_format": "yaml",
            "datasets": [{"path": tiny_inputs["data"], "data_folder": "", "data_type": "parquet"},
                         {"path": str(llava_dir / "clean.json"), "data_type": "json"}],
            "processor_config": {"processor_name": tiny_inputs["processor"],
                                 "processor_type": "qwen2_5_vl"},
            "packing": True, "packing_strategy": "first_fit", "packing_length": 384,
        },
        "model_config": {
            "load_from_config": {"model_type": "qwen2_5_vl", "tiny": True,
                                 "config": {"vision_config": {"patch_size": 14, "window_size": 112}}},
            "attn_implementation": "sdpa",
        },
        "trainer_args": {
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 1,
            "num_train_epochs": 1, "learning_rate": 1.0e-3, "bf16": False, "fp16": False,
            "gradient_checkpointing": True, "dataloader_num_workers": 0, "report_to": "none",
            "output_dir": str(tmp_path / "run"), "save_strategy": "steps", "save_steps": 0,
            "logging_dir": str(tmp_path / "tb"), "fsdp2": True, "use_rmpad": True,
            "lr_scheduler_type": "constant", "eval_strategy": "no",
        },
    }  # fmt: skip
    path = write_config(engine, tmp_path / "engine.yaml")
    assert convert_config_main([str(path), "-o", str(tmp_path / "out.yaml")]) == 0
    converted = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert converted["trainer_args"]["activation_checkpointing"] == "full"
    assert converted["dataset_config"]["dataset_path"] == [
        tiny_inputs["data"], str(llava_dir / "clean.json")
    ]  # fmt: skip
    cfg = load_config(path, ["trainer_args.save_final=false"])
    assert "is an lmms-engine config" in capsys.readouterr().err
    assert cfg.model_config.processor_path == tiny_inputs["processor"]
    assert cfg.trainer_args.gradient_accumulation_steps == 2
    train(cfg)
    err = capsys.readouterr().err  # the start banner and the one-line summary
    for needle in ("[lmms-train] model    qwen2_5_vl from qwen2_5_vl tiny config", "parameters",
                   "[lmms-train] devices  1 x cpu", "[lmms-train] data     ", "fresh start",
                   "[lmms-train] done: 1/1 steps", "final loss", "metrics.jsonl"):  # fmt: skip
        assert needle in err, (needle, err[-2000:])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in ln for ln in lines) >= 1


@pytest.mark.parametrize("family", ["sit", "wan"])
def test_check_data_reads_latent_batches(family, tmp_path):
    """Diffusion transformers' data plan (latent batches): check-data reads the records through
    the latent loader (bucket shapes, transformer tokens per sample, bad records, a sample)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "examples" / family / "tiny_cpu.yaml").read_text())
    d, m = raw["dataset_config"], raw["model_config"]
    data = tmp_path / ("shapes.parquet" if family == "sit" else "clips.parquet")
    d.update(
        dataset_path=str(data), generate_synthetic={**d["generate_synthetic"], "num_samples": 12}
    )
    if "processor_path" in m:
        m["processor_path"] = str(tmp_path / "processor")
    if family == "sit":  # one more file: a record whose image is missing
        (tmp_path / "more.jsonl").write_text(json.dumps({"image": "gone.png", "label": 1}) + "\n")
        check_data(config_from_dict(raw), num_records=1)  # generates the shapes
        d["dataset_path"] = [str(data), str(tmp_path / "more.jsonl")]
    r = check_data(config_from_dict(raw), num_records=20)
    text = r.text()
    assert r.total_records == (13 if family == "sit" else 12) and r.seen == r.total_records
    shape, tokens, media = (
        ("3x16x16", 64, "image") if family == "sit" else ("3x9x32x32", 80, "video")
    )
    assert r.good == 12 and set(r.lengths) == {tokens} and r.media[media] == 12
    assert r.shapes == {f"pixel_values {shape}": 12} and f"pixel_values {shape} 12" in text
    if family == "sit":
        assert r.bad == {"missing_media": 1} and "gone.png" in r.examples["missing_media"]
        assert "class " in r.sample and "missing_media=1" in text
    else:
        assert "caption [[a " in r.sample and "moving" in r.sample
    assert "steps per epoch" in text and "full batches" in text
