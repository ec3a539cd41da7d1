"""Model set-up pieces: config assembly, freezing by hook name / prefix, optimizer groups."""

from __future__ import annotations

import pytest
import torch

from lmms_train._errors import ConfigError
from lmms_train._forward import call_through_root
from lmms_train._model_setup import _freeze, deep_merge, model_config_dict
from lmms_train._optim_setup import build_optimizer, build_schedule
from lmms_train.config import config_from_dict


def _cfg(**trainer):
    return config_from_dict({
        "model_config": {"load_from_config": {"model_type": "qwen2_5_vl", "tiny": True,
                                              "config": {"vision_config": {"patch_size": 14}}}},
        "dataset_config": {"dataset_path": "x"},
        "trainer_args": trainer,
    })  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    from lmms_models import get_model_spec

    spec = get_model_spec("qwen2_5_vl")
    conf = model_config_dict(_cfg(), spec, {"vocab_size": 1100, "image_token_id": 7})
    torch.manual_seed(0)
    return spec, conf, spec.build(config=conf, attn_backend="sdpa")


def test_config_assembly(tiny):
    _, conf, _ = tiny
    assert conf["vision_config"]["patch_size"] == 14  # user key over the tiny config
    assert conf["text_config"]["vocab_size"] == 1100  # grown to fit the tokenizer
    assert conf["image_token_id"] == 7
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}


def test_freeze_and_optimizers(tiny):
    spec, _, model = tiny
    assert _freeze(model, spec, ["vision_tower"]) == ["vision_tower"]
    assert not any(p.requires_grad for p in spec.vision_tower(model).parameters())
    with pytest.raises(ConfigError, match="matches no module"):
        _freeze(model, spec, ["visoin_tower"])
    t = _cfg(optimizer="muon", learning_rate=1e-3, muon_learning_rate=2e-2).trainer_args
    opt = build_optimizer(model, spec, t)
    groups = {g["use_muon"]: g for g in opt.param_groups}
    assert groups[True]["lr"] == pytest.approx(2e-2) and groups[False]["lr"] == pytest.approx(1e-3)
    head = spec.lm_head(model).weight
    assert any(p is head for p in groups[False]["params"])  # head goes to AdamW
    sched = build_schedule(opt, t)
    assert sched.get_last_lr()[0] == pytest.approx(2e-2)
    for p in spec.vision_tower(model).parameters():
        p.requires_grad_(True)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "fla_gated_deltanet"])
def test_muon_groups_of_linear_attention_families(family):
    """Gated DeltaNet layers under Muon: projections take Muon, the depthwise short convolutions
    (``[C, 1, K]`` taps), ``A_log`` and ``dt_bias`` AdamW; routed experts a stacked Muon group."""
    from lmms_models import get_model_spec

    spec = get_model_spec(family)
    model = spec.build(config=spec.tiny_config(), device="meta")
    t = _cfg(optimizer="muon").trainer_args
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {}
    for g in build_optimizer(model, spec, t).param_groups:
        key = "adamw" if not g["use_muon"] else "stacked" if g["stacked"] else "muon"
        groups[key] = {names[id(p)] for p in g["params"]}
    for part in ("conv1d.weight", "A_log", "dt_bias"):
        assert {n for n in names.values() if part in n} <= groups["adamw"], part
        assert not any(part in n for n in groups["muon"]), part
    proj = "in_proj_qkv" if family == "qwen3_5_moe" else "attn.q_proj"
    assert any(proj in n for n in groups["muon"])
    assert ("stacked" in groups) == (family == "qwen3_5_moe")
    if family == "qwen3_5_moe":
        assert all("experts" in n for n in groups["stacked"])


def test_muon_groups_of_bagel():
    """BAGEL under Muon: both MoT expert sets' matrices take Muon; the other modalities' input
    and output projections (``spec.muon_adamw_modules``), the embedding table and the head
    AdamW (Muon on ``llm2vae`` / ``vae2llm`` made the tiny example's flow-matching loss diverge)."""
    from lmms_models import get_model_spec

    spec = get_model_spec("bagel")
    model = spec.build(config=spec.tiny_config(), device="meta")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {}
    for g in build_optimizer(model, spec, _cfg(optimizer="muon").trainer_args).param_groups:
        groups["muon" if g["use_muon"] else "adamw"] = {names[id(p)] for p in g["params"]}
    for part in ("vae2llm.weight", "llm2vae.weight", "time_embedder.mlp.0.weight",
                 "connector.fc1.weight", "patch_embedding.weight", "embed_tokens", "lm_head"):  # fmt: skip
        assert any(part in n for n in groups["adamw"]) and not any(
            part in n for n in groups["muon"]
        )
    for part in ("mlp.gate_proj", "mlp_moe_gen.gate_proj", "q_proj_moe_gen", "encoder.layers.0"):
        assert any(part in n for n in groups["muon"]), part


def test_optimizer_groups_over_master_weights(tiny):
    """With MasterWeights the model's names and modules still decide the groups (no decay on
    norms and biases; Muon off the embeddings and the head), and every stepped tensor is an fp32
    master, written back after the step."""
    from lmms_parallel import MasterWeights

    spec, conf, _ = tiny
    torch.manual_seed(0)
    model = spec.build(config=conf, attn_backend="sdpa")
    head, norm = spec.lm_head(model).weight, model.model.language_model.norm.weight
    mw = MasterWeights(model)
    masters = {id(m) for m in mw.parameters()}
    [head_m, norm_m] = mw.map_params([head, norm])
    t = _cfg(optimizer="muon", learning_rate=1e-3).trainer_args
    muon = {g["use_muon"]: g for g in build_optimizer(model, spec, t, mw).param_groups}
    assert any(p is head_m for p in muon[False]["params"])  # the head's master: AdamW
    assert not any(p is head_m for p in muon[True]["params"])
    assert muon[True]["params"] and all(p.ndim >= 2 for p in muon[True]["params"])
    adamw = build_optimizer(model, spec, _cfg(weight_decay=0.1).trainer_args, mw)
    decay = {g["weight_decay"]: g["params"] for g in adamw.param_groups}
    assert any(p is norm_m for p in decay[0.0]) and not any(p is norm_m for p in decay[0.1])
    stepped = [p for g in adamw.param_groups for p in g["params"]]
    assert {id(p) for p in stepped} == masters
    assert all(p.dtype == torch.float32 for p in stepped) and head.dtype == torch.bfloat16


def test_call_through_root_runs_hooks():
    m = torch.nn.Linear(2, 2)
    seen = []
    m.register_forward_pre_hook(lambda mod, args: seen.append("pre"))
    assert call_through_root(m, lambda: 41 + 1) == 42
    assert seen == ["pre"] and m(torch.ones(1, 2)).shape == (1, 2)  # forward restored


def test_every_model_family_has_a_data_processor():
    """Each registered model spec's `processor_family` has an lmms_data processor; text-only
    specs get the text processor (one class for all text families)."""
    import lmms_data
    from lmms_models import DiffusionSpec, get_model_spec, list_models

    for name in list_models():
        spec = get_model_spec(name)
        if isinstance(spec, DiffusionSpec):  # latent batches: lmms_data.build_latent_loader
            continue
        proc = lmms_data.PROCESSOR_REGISTRY.get(spec.processor_family)
        assert (proc is lmms_data.QwenTextProcessor) == (not spec.media_keys), name


def test_cpu_offload_without_fsdp_is_an_error(tiny):
    from lmms_train._dist import DistEnv
    from lmms_train._model_setup import build_model

    spec, _, _ = tiny
    with pytest.raises(ConfigError, match="fsdp_cpu_offload needs FSDP"):
        build_model(_cfg(fsdp_cpu_offload=True), DistEnv(), spec, None)


@pytest.mark.parametrize(
    ("keys", "decoder", "vision"),
    [
        ({"activation_checkpointing": "full"}, "all", "all"),
        ({"activation_checkpointing": "full", "activation_checkpointing_fraction": 0.5},
         "half", "half"),
        ({"activation_checkpointing": "full", "activation_checkpointing_fraction": 0.5,
          "vision_activation_checkpointing": "none"}, "half", "none"),
        ({"activation_checkpointing": "none", "vision_activation_checkpointing": "selective"},
         "none", "all"),
        ({"activation_checkpointing": "full", "vision_activation_checkpointing": "full",
          "vision_activation_checkpointing_fraction": 0.5}, "all", "half"),
    ],
)  # fmt: skip
def test_ac_per_tower(keys, decoder, vision):
    from lmms_models import get_model_spec
    from lmms_train._model_setup import _apply_ac

    spec = get_model_spec("qwen2_5_vl")
    conf = model_config_dict(_cfg(), spec, {"vocab_size": 1100})
    conf["text_config"]["num_hidden_layers"] = 4
    conf["vision_config"]["depth"] = 4
    model = spec.build(config=conf, attn_backend="sdpa")
    handles = _apply_ac(model, spec, _cfg(**keys).trainer_args)
    want = {"all": [True] * 4, "half": [False, True, False, True], "none": [False] * 4}
    for tower, expected in (("decoder_blocks", decoder), ("vision_blocks", vision)):
        got = ["forward" in b.__dict__ for b in getattr(spec, tower)(model)]
        assert got == want[expected], (tower, got)
    for h in handles:
        h.remove()
    assert not any("forward" in b.__dict__ for b in spec.decoder_blocks(model))


def test_ac_values_are_checked():
    with pytest.raises(ConfigError, match="activation_checkpointing_fraction must be in"):
        _cfg(activation_checkpointing_fraction=1.5)
    with pytest.raises(ConfigError, match="vision_activation_checkpointing"):
        _cfg(vision_activation_checkpointing="half")
    with pytest.raises(ConfigError, match="vision_activation_checkpointing_fraction must be in"):
        _cfg(vision_activation_checkpointing="full", vision_activation_checkpointing_fraction=-0.1)


def test_allocator_conf_defaults_to_expandable_segments_and_keeps_the_users():
    from lmms_train._dist import default_allocator_conf

    environ: dict[str, str] = {}
    assert default_allocator_conf(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        mine = {var: "max_split_size_mb:128"}
        assert not default_allocator_conf(mine)
        assert mine == {var: "max_split_size_mb:128"}


def test_fa4_kernel_cache_defaults_on_and_keeps_the_users():
    from lmms_train._dist import FA4_CACHE_VAR, default_kernel_cache

    environ: dict[str, str] = {}
    assert default_kernel_cache(environ) and environ == {FA4_CACHE_VAR: "1"}
    mine = {FA4_CACHE_VAR: "0"}
    assert not default_kernel_cache(mine) and mine == {FA4_CACHE_VAR: "0"}
