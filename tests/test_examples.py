"""Every example config parses and validates (unknown keys or bad values would fail here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmms_train.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"))
FAMILIES = (
    "qwen2",
    "qwen2_5",
    "qwen3",
    "qwen3_moe",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen2_audio",
    "qwen2_5_omni",
    "qwen3_omni_moe",
    "aero",
)
FAMILIES += ("llava_onevision",)  # anyres images, multi-image, video
FAMILIES += ("qwen3_5", "qwen3_5_moe", "fla_gated_deltanet")  # linear attention (Gated DeltaNet)
FAMILIES += ("llama",)  # also LLaDA's checkpoint layout (docs/diffusion-lm.md)
FAMILIES += ("bagel",)  # unified understanding + generation (ce_flow_matching)


def test_every_family_has_examples():
    names = {p.parent.name for p in EXAMPLES}
    assert set(FAMILIES) <= names, set(FAMILIES) - names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.trainer_args.max_steps > 0


TINY = {  # each family's tiny CPU example
    "qwen2": "qwen2/tiny_cpu.yaml",
    "qwen2_5": "qwen2_5/tiny_cpu.yaml",
    "qwen3": "qwen3/tiny_cpu.yaml",
    "qwen3_moe": "qwen3_moe/tiny_cpu.yaml",
    "qwen2_5_vl": "qwen2_5_vl/tiny_cpu_muon.yaml",
    "qwen3_vl": "qwen3_vl/tiny_cpu.yaml",
    "llava_onevision": "llava_onevision/tiny_cpu.yaml",
    "qwen3_vl_moe": "qwen3_vl_moe/tiny_cpu.yaml",
    "qwen2_audio": "qwen2_audio/tiny_cpu.yaml",
    "qwen2_5_omni": "qwen2_5_omni/tiny_cpu.yaml",
    "qwen3_omni_moe": "qwen3_omni_moe/tiny_cpu.yaml",
    "aero": "aero/tiny_cpu.yaml",
    "qwen3_5": "qwen3_5/tiny_cpu.yaml",
    "qwen3_5_moe": "qwen3_5_moe/tiny_cpu.yaml",
    "fla_gated_deltanet": "fla_gated_deltanet/tiny_cpu.yaml",
    "llama": "llama/tiny_cpu.yaml",
    "bagel": "bagel/tiny_cpu.yaml",
}


def test_every_family_has_a_tiny_cpu_example():
    assert set(TINY) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_example_trains(family, tmp_path):
    """Two steps of the family's tiny example through the trainer's Python API (in this process),
    from a fresh folder: the synthetic data and the local tokenizer/processor are generated."""
    import json
    import math

    import pyarrow.parquet as pq

    from lmms_train import train

    path = Path(__file__).resolve().parents[1] / "examples" / TINY[family]
    data = tmp_path / "data"
    cfg = load_config(path, [
        f"model_config.processor_path={tmp_path / 'processor'}",
        f"dataset_config.dataset_path={data}", "dataset_config.generate_synthetic.num_samples=48",
        f"trainer_args.output_dir={tmp_path / 'out'}", "trainer_args.max_steps=2",
        "trainer_args.save_steps=0", "trainer_args.eval_steps=0", "trainer_args.report_to=[]",
    ])  # fmt: skip
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], rows
    assert all(math.isfinite(r["loss"]) and 0 < r["loss"] < 10 for r in steps), steps
    assert all(r["samples"] > 0 and r["bad_records"] == 0 for r in steps), steps
    vl = "_vl" in family or family in ("llava_onevision", "qwen3_5", "qwen3_5_moe", "bagel")
    omni = family in ("qwen2_5_omni", "qwen3_omni_moe")
    if not omni:  # omni data: image shards and audio shards, packs of either
        assert all((r["vision_tokens"] > 0) == vl for r in steps), steps
    columns = set().union(*(pq.read_schema(p).names for p in data.glob("*.parquet")))
    assert ("images" in columns) == (vl or omni), columns  # text for text
    assert ("audios" in columns) == (omni or family in ("qwen2_audio", "aero")), columns
