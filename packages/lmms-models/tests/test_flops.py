"""FLOP estimators against hand counts and against the built modules' parameter counts."""

from __future__ import annotations

import pytest
import torch

from lmms_models import get_model_spec


def _params(module, skip=()):
    return sum(p.numel() for n, p in module.named_parameters() if not any(s in n for s in skip))


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama", "qwen2_5_vl", "qwen3_vl"])
def test_lm_matmul_params_match_module(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    # LM: everything but the embedding lookup and the vision tower; lm_head counts (a matmul).
    expected = _params(model, skip=("embed_tokens", "visual"))
    assert spec.lm_matmul_params(model.config) == expected


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_vl_moe", "qwen3_omni_moe"])
def test_moe_counts_active_experts_only(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    cfg = spec.text_config(model.config)
    all_params = _params(model, skip=("embed_tokens", "visual", "audio_tower"))
    inactive = cfg.num_hidden_layers * (4 - 2) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert spec.lm_matmul_params(model.config) == all_params - inactive


def test_lm_flops_hand_count():
    spec = get_model_spec("qwen2")
    cfg = spec.make_config(spec.tiny_config())
    # tiny: h=64, 4 heads x 16, 2 kv heads, I=128, 2 layers, V=1024, q/k/v biases.
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    n = 2 * per_layer + 64 + 64 * 1024
    assert spec.lm_matmul_params(cfg) == n
    lens = [3, 5]
    attn = 12 * 2 * 64 * (9 + 25)
    assert spec.lm_flops(cfg, lens) == 6 * n * 8 + attn
    assert spec.lm_flops(cfg, lens, causal_half=True) == 6 * n * 8 + attn / 2
    assert spec.lm_flops_per_token(cfg, lens) == (6 * n * 8 + attn) / 8


def test_qwen2_5_vl_vision_flops_hand_count():
    spec = get_model_spec("qwen2_5_vl")
    model = spec.build(config=spec.tiny_config(), device="meta")
    cfg = model.config
    p = spec.vision_matmul_params(cfg)
    tower = spec.vision_tower(model)
    merger_mlp = _params(tower.merger.mlp)
    assert p["per_merged"] == merger_mlp
    assert p["per_patch"] + merger_mlp == _params(tower)
    # grid (1, 6, 4): 24 patches; merged 3x2, windows of 2x2 merged -> widths {2,1} x {2}:
    # window patch counts 16 and 8 -> Σs² = 256 + 64; full layer Σs² = 24².
    grid = torch.tensor([[1, 6, 4]])
    attn = 12 * 32 * (1 * 24**2 + 2 * (16**2 + 8**2))  # 1 full layer, 2 window layers
    dense = 6 * (p["per_patch"] * 24 + p["per_merged"] * 24 / 4)
    assert spec.vision_flops(cfg, grid) == pytest.approx(dense + attn)
    # A 2-frame video attends per frame in both layer kinds.
    assert spec.vision_flops(cfg, torch.tensor([[2, 6, 4]])) == pytest.approx(2 * (dense + attn))


def test_qwen3_vl_vision_params_match_module():
    spec = get_model_spec("qwen3_vl")
    model = spec.build(config=spec.tiny_config(), device="meta")
    tower = spec.vision_tower(model)
    p = spec.vision_matmul_params(model.config)
    assert p["per_patch"] + p["per_merged"] == _params(tower, skip=("pos_embed",))
    grid = torch.tensor([[1, 4, 4]])
    expected = 6 * (p["per_patch"] * 16 + p["per_merged"] * 4) + 12 * 32 * 3 * 16**2
    assert spec.vision_flops(model.config, grid) == pytest.approx(expected)


def test_preset_3b_is_the_published_shape():
    spec = get_model_spec("qwen2_5_vl")
    model = spec.build(config=spec.preset("3b"), device="meta")
    n_lm = spec.lm_matmul_params(model.config)
    n_vit = _params(spec.vision_tower(model))
    assert 3.05e9 < n_lm < 3.12e9  # Qwen2.5-3B: ~3.09B (the tied head counted once)
    assert 0.66e9 < n_vit < 0.68e9
    with pytest.raises(KeyError, match="presets: 3b"):
        spec.preset("7b")


def test_llava_onevision_params_match_module():
    spec = get_model_spec("llava_onevision")
    model = spec.build(config=spec.tiny_config(), device="meta")
    base = spec.base_model(model)
    lm = _params(model, skip=("embed_tokens", "vision_tower", "multi_modal_projector", "newline"))
    assert spec.lm_matmul_params(model.config) == lm
    p = spec.vision_matmul_params(model.config)
    tower = _params(spec.vision_tower(model), skip=("position_embedding",))
    assert p["per_patch"] == tower
    assert p["per_token"] == _params(base.multi_modal_projector)
    # 3 tiles of 4x4 patches: 6N per patch and projected token, full attention per tile per layer
    expected = 6 * 3 * 16 * (p["per_patch"] + p["per_token"]) + 12 * 32 * 2 * 3 * 16**2
    assert spec.vision_flops(model.config, 3) == pytest.approx(expected)
    batch = {
        "pixel_values": torch.zeros(2, 3, 32, 32),
        "pixel_values_videos": torch.zeros(1, 3, 32, 32),
    }
    assert spec.pack_vision_flops(model.config, batch) == pytest.approx(expected)
    for name, (lo, hi) in {"0.5b": (0.48e9, 0.50e9), "7b": (7.0e9, 7.7e9)}.items():
        big = spec.build(config=spec.preset(name), device="meta")
        assert lo < spec.lm_matmul_params(big.config) < hi, name
        assert 0.39e9 < _params(spec.vision_tower(big)) < 0.41e9  # SigLIP-so400m, 26 layers
