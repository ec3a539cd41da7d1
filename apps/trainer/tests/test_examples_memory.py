"""Every `examples/*/gpu*.yaml` says in its header how many 80 GB GPUs it needs, and the memory
plan agrees (issue 38, CPU): the plan of the example's own layout fits that many and, where fewer
are allowed by its parallel degrees, not half as many. Examples that read a local checkpoint are
planned for the published shape their header names (`SHAPES`). Families without block shapes for
the plan (SiT, Wan, BAGEL: `ModelSpec.memory_towers` not given) are checked on their weights,
gradients and optimizer state alone, a lower bound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmms_train._memory import (
    DEFAULT_GPU_GIB,
    GIB,
    fsdp_shards,
    layout_of,
    model_facts,
    plan_memory,
    state_bytes,
)
from lmms_train._model_setup import resolve_spec
from lmms_train.config import load_config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*/*gpu*.yaml"))
HEADER = re.compile(r"^# Memory \(lmms-train plan[^)]*\): (fits one|needs (\d+) x) 80 GB GPU", re.M)
_Q3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              tie_word_embeddings=False)  # fmt: skip
#: The published shape each checkpoint-folder example is planned for (its header names it)
SHAPES = {
    "aero/1_5b_gpu.yaml": {"model_type": "aero", "preset": "1.5b"},
    "llama/llada_8b_gpu_muon.yaml": {"model_type": "llama", "preset": "llada_8b"},
    "llava_onevision/7b_gpu.yaml": {"model_type": "llava_onevision", "preset": "7b"},
    "qwen2/gpu.yaml": {"model_type": "qwen2", "config": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)},
    "qwen2_5/3b_gpu.yaml": {"model_type": "qwen2_5", "preset": "3b"},
    "qwen2_5_vl/3b_gpu.yaml": {"model_type": "qwen2_5_vl", "preset": "3b"},
    "qwen2_5_vl/3b_gpu_muon_32k.yaml": {"model_type": "qwen2_5_vl", "preset": "3b"},
    "qwen2_audio/7b_gpu.yaml": {"model_type": "qwen2_audio", "preset": "7b"},
    "qwen3/gpu.yaml": {"model_type": "qwen3", "config": _Q3_8B},
    "qwen3_5/gpu.yaml": {"model_type": "qwen3_5", "preset": "2b"},
    "qwen3_5_moe/gpu.yaml": {"model_type": "qwen3_5_moe", "preset": "35b_a3b"},
    "qwen3_moe/gpu.yaml": {"model_type": "qwen3_moe", "config": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)},
    "qwen3_vl/gpu.yaml": {"model_type": "qwen3_vl", "config": {
        "text_config": _Q3_8B, "vision_config": {"out_hidden_size": 4096}}},
    "bagel/7b_mot_gpu.yaml": {"model_type": "bagel", "preset": "7b-mot"},
    "wan/14b_gpu.yaml": {"model_type": "wan", "preset": "14b"},
    "wan/1p3b_gpu.yaml": {"model_type": "wan", "preset": "1.3b"},
}  # fmt: skip


def _config(path: Path):
    name = f"{path.parent.name}/{path.name}"
    overrides = []
    if name in SHAPES:
        overrides = [
            "model_config.load_from_pretrained_path=null",
            "model_config.load_from_config=" + json.dumps(SHAPES[name]),
        ]
    return load_config(str(path), overrides)


def declared_gpus(path: Path) -> int:
    match = HEADER.search(path.read_text())
    assert match, f"{path}: no '# Memory (lmms-train plan...): fits one / needs N x 80 GB GPU' line"
    return 1 if match.group(1) == "fits one" else int(match.group(2))


def planned_need(cfg, facts, gpus: int) -> tuple[float, bool]:
    """(GiB needed per GPU, fits) on `gpus` 80 GB GPUs; state alone without block shapes."""
    lay = layout_of(cfg, gpus=gpus)
    if facts.towers:
        plan = plan_memory(facts, lay, DEFAULT_GPU_GIB)
        return plan.needed / GIB, plan.fits
    state = sum(state_bytes(facts, lay).values()) / fsdp_shards(lay) / GIB
    return state, state <= DEFAULT_GPU_GIB


@pytest.mark.parametrize("path", EXAMPLES, ids=[f"{p.parent.name}/{p.name}" for p in EXAMPLES])
def test_header_gpu_count_agrees_with_the_plan(path):
    n = declared_gpus(path)
    cfg = _config(path)
    facts = model_facts(cfg, resolve_spec(cfg))
    need, fits = planned_need(cfg, facts, n)
    assert fits, f"{path.name}: header says {n} x 80 GB, the plan needs {need:.1f} GiB per GPU"
    t = cfg.trainer_args
    unit = t.sp_ulysses_degree * t.tp_degree * t.ep_degree * t.dp_replicate
    if n > 1 and (n // 2) % unit == 0 and facts.towers:
        half, fits_half = planned_need(cfg, facts, n // 2)
        assert not fits_half, f"{path.name}: header says {n} GPUs, {n // 2} fit ({half:.1f} GiB)"
