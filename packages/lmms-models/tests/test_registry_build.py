"""Registry behaviour, building (config / pretrained folder / meta) and the parallel hooks."""

from __future__ import annotations

import pytest
import torch

from lmms_models import MODEL_REGISTRY, ModelSpec, get_model_spec, list_models, register_model

FAMILIES = [
    "llama",
    "llava_onevision",
    "qwen2",
    "qwen2_5",
    "qwen2_5_vl",
    "qwen3",
    "qwen3_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
]
DIFFUSION_FAMILIES = ["sit", "wan"]  # flow matching: tests/test_diffusion_families.py
# audio towers: tests/test_audio_families.py
AUDIO_FAMILIES = ["aero", "qwen2_5_omni", "qwen2_audio", "qwen3_omni_moe"]
# linear attention (Gated DeltaNet): tests/test_linear_families.py
LINEAR_FAMILIES = ["fla_gated_deltanet", "qwen3_5", "qwen3_5_moe"]
UNIFIED_FAMILIES = ["bagel"]  # own module, CE + flow matching: tests/test_bagel.py


def test_registry_lists_families_and_refuses_duplicates():
    assert list_models() == sorted(
        FAMILIES + DIFFUSION_FAMILIES + AUDIO_FAMILIES + LINEAR_FAMILIES + UNIFIED_FAMILIES
    )
    with pytest.raises(ValueError, match="already registered"):
        register_model("qwen2")(type("Dup", (ModelSpec,), {}))
    with pytest.raises(KeyError, match=r"Did you mean 'qwen2_5_vl'.*Registered: .*qwen2, qwen2_5"):
        get_model_spec("qwen25_vl")
    assert MODEL_REGISTRY["qwen3_vl"].name == "qwen3_vl"


def test_tiny_config_is_a_fresh_copy_every_call():
    """A test may edit the dict it gets (GPU tests change head counts) without changing the
    family's constant, or any later test's config."""

    def leaves(d, path=()):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, (*path, k))
            else:
                yield (*path, k), v

    for name in list_models():
        first = get_model_spec(name).tiny_config()
        want = dict(leaves(first))
        stack = [first]
        while stack:  # scribble over every level of the dict we were given
            d = stack.pop()
            for k, v in list(d.items()):
                if isinstance(v, dict):
                    stack.append(v)
                else:
                    d[k] = "edited"
        assert dict(leaves(get_model_spec(name).tiny_config())) == want, name


@pytest.mark.parametrize("name", FAMILIES)
def test_build_meta_and_hooks(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    assert all(p.is_meta for p in model.parameters())
    n_layers = spec.text_config(model.config).num_hidden_layers
    assert len(spec.decoder_blocks(model)) == n_layers
    assert spec.sp_slice_module(model) is spec.text_model(model)
    assert spec.embeddings(model)[0] is spec.text_model(model).embed_tokens
    assert spec.lm_head(model) is model.lm_head
    vl = "pixel_values" in spec.media_keys
    assert (spec.vision_tower(model) is not None) == vl
    vc = getattr(model.config, "vision_config", None)
    depth = (getattr(vc, "depth", None) or vc.num_hidden_layers) if vl else 0  # Qwen-VL / SigLIP
    assert len(spec.vision_blocks(model)) == depth
    assert len(spec.block_classes(model)) == (2 if vl else 1)
    assert spec.processor_family


def test_tiny_token_ids_are_configurable():
    spec = get_model_spec("qwen2_5_vl")
    cfg = spec.tiny_config(image_token_id=900, text_config={"vocab_size": 2048})
    assert cfg["image_token_id"] == 900 and cfg["text_config"]["vocab_size"] == 2048
    assert cfg["text_config"]["hidden_size"] == 64  # nested dicts are merged, not replaced
    model = spec.build(config=cfg, device="meta")
    assert model.config.image_token_id == 900


def test_build_from_pretrained_folder(tmp_path):
    spec = get_model_spec("qwen3")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    model.save_pretrained(tmp_path)
    loaded = spec.build(pretrained=str(tmp_path), attn_backend="sdpa")
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)
    meta = spec.build(pretrained=str(tmp_path), device="meta")
    assert next(meta.parameters()).is_meta
    with pytest.raises(ValueError, match="exactly one"):
        spec.build()


def test_wrong_model_type_and_bad_positions_raise():
    spec = get_model_spec("qwen2_5_vl")
    with pytest.raises(ValueError, match="model_type"):
        spec.make_config({"model_type": "qwen2"})
    with pytest.raises(ValueError, match=r"position_ids \[4, T\]"):
        spec.pack_position_ids({"position_ids": torch.zeros(3, 5, dtype=torch.long)}, 5, "cpu")


def test_attention_switch_sets_both_towers():
    spec = get_model_spec("qwen2_5_vl")
    model = spec.build(config=spec.tiny_config(), device="meta", attn_backend="varlen_sdpa")
    assert model.config.text_config._attn_implementation == "lmms_flash_text_varlen_sdpa"
    assert model.config.vision_config._attn_implementation == "lmms_flash_vision_varlen_sdpa"
    assert spec.vision_tower(model).config._attn_implementation == "lmms_flash_vision_varlen_sdpa"
    assert spec.decoder_blocks(model)[0].self_attn.config._attn_implementation.startswith(
        "lmms_flash_text"
    )
    spec.set_attention(model, backend="eager")
    assert spec.vision_tower(model).config._attn_implementation == "eager"


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"])
def test_dummy_vision_inputs_run_the_tower(name):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    tower = spec.vision_tower(model)
    inputs = spec.dummy_vision_inputs(model, torch.device("cpu"))
    out = tower(**inputs)
    merged = out.pooler_output if hasattr(out, "pooler_output") else out[0]
    # one merged token of the language model's width
    assert merged.shape == (1, model.config.text_config.hidden_size)
    assert inputs["grid_thw"].tolist() == [[1, 2, 2]]


def test_the_vision_tower_can_take_its_own_attention_backend():
    spec = get_model_spec("qwen2_5_vl")
    model = spec.build(
        config=spec.tiny_config(),
        device="meta",
        attn_backend="varlen_sdpa",
        vision_attn_backend="flex",
    )
    assert model.config.text_config._attn_implementation == "lmms_flash_text_varlen_sdpa"
    assert spec.vision_tower(model).config._attn_implementation == "lmms_flash_vision_flex"
    names = spec.set_attention(model, backend="varlen_sdpa", vision_backend="sdpa")
    assert names == {"text": "lmms_flash_text_varlen_sdpa", "vision": "sdpa"}
    assert spec.vision_tower(model).config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        spec.set_attention(model, backend="varlen_sdpa", vision_backend="nope")
