"""BAGEL (family ``bagel``, objective ``ce_flow_matching``) on CPU: span masks against an
independent reference, packed == unpacked (loss and gradients) for understanding, generation,
editing and mixed packs with a length-1 sample, FlexAttention == per-sample SDPA, the public
checkpoint's key layout at the 7B-MoT preset, deterministic noise draws, AC, FSDP2 2 ranks == 1
and Ulysses SP 2 == 1 (gloo); the FLUX-layout VAE loads into diffusers' AutoencoderKL."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _bagel_cases as cases

from lmms_models import get_model_spec
from lmms_models.families.bagel import CAUSAL, NOISE, dense_mask


def _reference_mask(splits: list[tuple[int, int]]) -> torch.Tensor:
    """The rule written split by split: a split sees all earlier splits and itself (causally for
    text, wholly for images); then a noised split is hidden from every other split."""
    n = sum(s for s, _ in splits)
    m = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for s, mode in splits:
        m[start : start + s, :start] = True
        block = torch.ones(s, s, dtype=torch.bool)
        m[start : start + s, start : start + s] = block.tril() if mode == CAUSAL else block
        start += s
    start = 0
    for s, mode in splits:
        if mode == NOISE:
            m[:, start : start + s] = False
            m[start : start + s, start : start + s] = True
        start += s
    return m


def test_span_mask_matches_split_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k = int(torch.randint(1, 7, (1,), generator=g))
        splits = [(int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(0, 3, (1,), generator=g)))
                  for _ in range(k)]  # fmt: skip
        sid = torch.cat([torch.full((s,), i) for i, (s, _) in enumerate(splits)])
        mode = torch.cat([torch.full((s,), m) for s, m in splits])
        assert torch.equal(dense_mask(sid, mode), _reference_mask(splits)), splits


@pytest.fixture(scope="module")
def tiny():
    return cases.tiny_model()


@pytest.mark.parametrize("kind", sorted(cases.PACKS))
def test_packed_equals_unpacked(tiny, kind):
    spec, model = tiny
    names = cases.PACKS[kind]
    loss, sums, grads = cases.loss_grads(spec, model, cases.pack(names), total=10.0)
    ref_loss, ref_ce, ref_fm = 0.0, 0.0, 0.0
    ref = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for name in names:
        lo, s, g = cases.loss_grads(spec, model, cases.pack([name]), total=10.0)
        ref_loss, ref_ce, ref_fm = ref_loss + lo, ref_ce + s["ce"], ref_fm + s["fm"]
        for n in ref:
            ref[n] += g[n]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert sums["ce"] == pytest.approx(ref_ce, rel=1e-5)
    assert sums["fm"] == pytest.approx(ref_fm, rel=1e-5, abs=1e-7)
    if kind != "understanding":
        assert sums["fm"] > 0  # the generation term is really there
    assert cases.worst(ref, grads) < 1e-4
    # both experts and both towers are trained by the mixed pack
    if kind == "mixed":
        for key in ("self_attn.q_proj_moe_gen.weight", "mlp.gate_proj.weight", "vision_model",
                    "llm2vae.weight", "time_embedder.mlp.0.weight"):  # fmt: skip
            assert any(key in n and float(g.abs().sum()) > 0 for n, g in grads.items()), key


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_per_mot_layer_is_exact(mode):
    """lmms_parallel's AC on every MoT decoder layer and ViT layer: same loss and gradients."""
    from lmms_parallel import apply_activation_checkpointing

    spec, model = cases.tiny_model()
    batch = cases.pack(cases.PACKS["mixed"])
    ref_loss, _, ref = cases.loss_grads(spec, model, batch)
    blocks = spec.decoder_blocks(model) + spec.vision_blocks(model)
    handle = apply_activation_checkpointing(blocks, mode)
    assert len(handle.blocks) == 4
    loss, _, grads = cases.loss_grads(spec, model, cases.pack(cases.PACKS["mixed"]))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert cases.worst(ref, grads) < 1e-5


def test_mot_flops_count_one_expert_per_token(tiny):
    """The per-token matmul parameters of mot_flops are one expert's share of a decoder layer."""
    spec, model = tiny
    conf = spec.tiny_config()
    layer = spec.decoder_blocks(model)[0]
    one_expert = sum(
        p.numel() for n, p in layer.named_parameters()
        if "moe_gen" not in n and p.dim() == 2  # matmul weights of the understanding set
    )  # fmt: skip
    batch = cases.pack(["text"])  # text only: no ViT / VAE terms
    t, n_ce = batch["input_ids"].numel(), batch["num_ce_tokens"]
    cfg = spec.make_config(conf)
    h, v, layers = cfg.llm.hidden_size, cfg.llm.vocab_size, cfg.llm.num_hidden_layers
    pairs = t * (t + 1) // 2
    expected = 6.0 * layers * one_expert * t + 6.0 * h * v * n_ce + 12.0 * layers * h * pairs
    assert spec.mot_flops(conf, batch) == pytest.approx(expected)


def test_pack_flops_count_every_executed_matmul_of_both_experts_and_the_vit(tiny):
    """On the mixed pack (understanding, generation, editing, text), ``pack_flops`` equals the
    matmuls the forward actually runs, measured by hooks on every ``nn.Linear`` (3 x forward for
    training): decoder layers of both expert sets (each token through its own), the ViT, the
    connector and latent projections; plus the LM head on supervised text and attention over the
    mask's allowed pairs (decoder) and each image's own patches (ViT)."""
    from lmms_models.objectives import ObjectiveContext, get_objective

    spec, model = tiny
    batch = cases.pack(cases.PACKS["mixed"])
    done: dict[str, float] = {"dec": 0.0, "vit": 0.0, "other": 0.0, "gen": 0.0}

    def hook(name: str):
        def fn(mod: torch.nn.Linear, args: tuple, _out: torch.Tensor) -> None:
            rows = args[0].numel() // mod.in_features
            part = "dec" if ".layers." in name and name.startswith("language_model") else (
                "vit" if name.startswith("vit_model") else "other")  # fmt: skip
            done[part] += 2.0 * rows * mod.in_features * mod.out_features
            if "moe_gen" in name:
                done["gen"] += rows

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]  # fmt: skip
    try:
        get_objective("ce_flow_matching").loss(spec, model, batch, ObjectiveContext(seed=0))
    finally:
        for h in handles:
            h.remove()
    assert done["gen"] > 0  # the generation expert ran on the latent tokens
    cfg = model.config
    h, lv, vh = cfg.llm.hidden_size, cfg.llm.num_hidden_layers, cfg.vit.hidden_size
    pairs = sum(int(m.sum()) for m in batch["layout"].sample_masks())
    lens = (batch["vit_cu"][1:] - batch["vit_cu"][:-1]).tolist()
    lm = 3 * done["dec"] + 6.0 * h * cfg.llm.vocab_size * batch["num_ce_tokens"]
    lm += 12.0 * lv * h * pairs
    media = 3 * (done["vit"] + done["other"])
    media += 12.0 * cfg.vit.num_hidden_layers * vh * sum(n * n for n in lens)
    got = spec.pack_flops(spec.tiny_config(), batch)
    assert got == (pytest.approx(lm), pytest.approx(media))


def test_flex_block_mask_equals_per_sample_sdpa(tiny):
    """FlexAttention on CPU runs forward only (no CPU backward in torch): values here, gradients in
    the GPU test."""
    from lmms_models.objectives import ObjectiveContext, get_objective

    spec, model = tiny
    obj = get_objective("ce_flow_matching")
    with torch.no_grad():
        a = obj.loss(spec, model, cases.pack(cases.PACKS["mixed"]), ObjectiveContext(seed=3))
        b = obj.loss(spec, model, cases.pack(cases.PACKS["mixed"], backend="flex"),
                     ObjectiveContext(seed=3))  # fmt: skip
    assert float(b.loss_sum) == pytest.approx(float(a.loss_sum), rel=1e-5)
    assert float(b.metrics["fm"][0]) == pytest.approx(float(a.metrics["fm"][0]), rel=1e-5)


def test_text_only_pack_takes_varlen_attention(tiny):
    batch = cases.pack(["text", "one"])
    assert batch["layout"].all_causal and batch["num_fm_tokens"] == 0
    assert not cases.pack(["und"])["layout"].all_causal


def test_noise_draws_are_deterministic_per_sample(tiny):
    spec, model = tiny
    a, _, _ = cases.loss_grads(spec, model, cases.pack(["gen", "edit"]))
    b, _, _ = cases.loss_grads(spec, model, cases.pack(["gen", "edit"]))
    c, _, _ = cases.loss_grads(spec, model, cases.pack(["gen", "edit"]), seed=4)
    assert a == b  # bit for bit: what a resumed step redraws
    assert a != c  # the run seed enters the draws


def test_objective_options_and_errors(tiny):
    from lmms_models.objectives import get_objective

    obj = get_objective("ce_flow_matching", ce_weight=0.25, flow_matching={"shift": 3.0})
    assert obj.options.fm_config.shift == 3.0 and obj.options.fm_config.timestep_scale == 1.0
    with pytest.raises(TypeError, match="did you mean 'fm_weight'"):
        get_objective("ce_flow_matching", fm_weigth=1.0)
    with pytest.raises(ValueError, match="weights"):
        get_objective("ce_flow_matching", ce_weight=-1.0)
    from lmms_models.objectives import ObjectiveContext

    qwen = get_model_spec("qwen2")
    with pytest.raises(TypeError, match="unified family"):
        obj.loss(qwen, None, {}, ObjectiveContext())


# Names and shapes of the public BAGEL-7B-MoT checkpoint (ema.safetensors), a sample per module.
_PUBLIC_7B = {
    "language_model.model.embed_tokens.weight": (152064, 3584),
    "language_model.lm_head.weight": (152064, 3584),
    "language_model.model.norm.weight": (3584,),
    "language_model.model.norm_moe_gen.weight": (3584,),
    "language_model.model.layers.27.self_attn.q_proj.weight": (3584, 3584),
    "language_model.model.layers.27.self_attn.q_proj.bias": (3584,),
    "language_model.model.layers.27.self_attn.k_proj_moe_gen.weight": (512, 3584),
    "language_model.model.layers.27.self_attn.v_proj_moe_gen.bias": (512,),
    "language_model.model.layers.27.self_attn.o_proj_moe_gen.weight": (3584, 3584),
    "language_model.model.layers.0.self_attn.q_norm.weight": (128,),
    "language_model.model.layers.0.self_attn.k_norm_moe_gen.weight": (128,),
    "language_model.model.layers.0.mlp.gate_proj.weight": (18944, 3584),
    "language_model.model.layers.0.mlp_moe_gen.down_proj.weight": (3584, 18944),
    "language_model.model.layers.0.input_layernorm_moe_gen.weight": (3584,),
    "language_model.model.layers.0.post_attention_layernorm_moe_gen.weight": (3584,),
    "vit_model.vision_model.embeddings.patch_embedding.weight": (1152, 588),
    "vit_model.vision_model.embeddings.patch_embedding.bias": (1152,),
    "vit_model.vision_model.embeddings.position_embedding.weight": (4900, 1152),
    "vit_model.vision_model.encoder.layers.25.self_attn.out_proj.weight": (1152, 1152),
    "vit_model.vision_model.encoder.layers.25.mlp.fc1.weight": (4304, 1152),
    "vit_model.vision_model.encoder.layers.25.layer_norm2.bias": (1152,),
    "vit_model.vision_model.post_layernorm.weight": (1152,),
    "connector.fc1.weight": (3584, 1152),
    "connector.fc2.weight": (3584, 3584),
    "vit_pos_embed.pos_embed": (4900, 3584),
    "time_embedder.mlp.0.weight": (3584, 256),
    "time_embedder.mlp.2.weight": (3584, 3584),
    "vae2llm.weight": (3584, 64),
    "llm2vae.weight": (64, 3584),
    "latent_pos_embed.pos_embed": (4096, 3584),
}


def test_state_dict_matches_public_layout_at_7b_mot():
    spec = get_model_spec("bagel")
    model = spec.build(config=spec.preset("7b-mot"), device="meta")
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key, shape in _PUBLIC_7B.items():
        assert sd.get(key) == shape, (key, sd.get(key), shape)
    layers = {k.split(".")[3] for k in sd if k.startswith("language_model.model.layers.")}
    vit = {k.split(".")[4] for k in sd if k.startswith("vit_model.vision_model.encoder.layers.")}
    assert len(layers) == 28 and len(vit) == 26
    per_layer = [k for k in sd if k.startswith("language_model.model.layers.0.")]
    assert len(per_layer) == 2 * (7 + 2 + 3 + 2)  # q/k/v (w, b), o, q/k norm, mlp x3, 2 norms
    assert not any("rotary" in k for k in sd)
    total = sum(p.numel() for p in model.parameters())
    assert 14.0e9 < total < 14.8e9  # "7B active, 14B total"


def test_registry_hooks(tiny):
    spec, model = tiny
    assert len(spec.decoder_blocks(model)) == 2 and len(spec.vision_blocks(model)) == 2
    assert spec.lm_head(model) is model.language_model.lm_head
    assert spec.default_objective == "ce_flow_matching"


TWO_RANK_WORKER = "_bagel_workers:run"  # run in conftest's session-wide 2-rank spawn


@pytest.fixture(scope="module")
def spawned(two_ranks) -> list[dict]:
    return two_ranks(TWO_RANK_WORKER)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["fsdp", "sp", "sp_lm"])
def test_two_ranks_equal_one_process(spawned, case):
    """FSDP2 (a unit per MoT layer and ViT layer) and Ulysses SP 2 (ce_flow_matching, and
    causal_lm through packed_forward), each == 1 process."""
    for rank, res in enumerate(spawned):
        got = res[case]
        assert "error" not in got, got.get("error")
        assert got["loss"] == pytest.approx(got["loss_1proc"], rel=1e-5), rank
        assert got["worst"] < 1e-4, (rank, got["worst"])
        assert got.get("restored", True) and got.get("same_params", True), (rank, got)


@pytest.mark.gpu
def test_flex_block_mask_gradients_equal_sdpa_on_gpu():
    """Compiled FlexAttention (block-sparse span mask over the whole row) == per-sample SDPA on a
    CUDA device, loss and gradients, for the mixed pack."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lmms_models.families.bagel import batch_to

    spec, model = cases.tiny_model()
    model = model.cuda()
    a_loss, _, a = cases.loss_grads(spec, model, batch_to(cases.pack(cases.PACKS["mixed"]), "cuda"))
    flex = batch_to(cases.pack(cases.PACKS["mixed"], backend="flex"), "cuda")
    b_loss, _, b = cases.loss_grads(spec, model, flex)
    assert b_loss == pytest.approx(a_loss, rel=1e-4)
    assert cases.worst(a, b) < 1e-3


def test_pretrained_folder_round_trip_and_frozen_vae(tmp_path):
    """A folder with config.json + ema.safetensors (the public file name) and a diffusers VAE in
    vae/ builds the same model; the VAE encodes generation pixels and stays outside the state."""
    pytest.importorskip("diffusers")
    from safetensors.torch import save_file

    from lmms_models.families.bagel import pack_samples

    spec, model = cases.tiny_model()
    conf = spec.tiny_config()
    vae_conf = dict(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
        layers_per_block=1,
    )  # fmt: skip
    spec.attach_vae(model, vae_conf)
    assert not any(k.startswith(("vae.", "encoder.", "decoder.")) for k in model.state_dict())
    (tmp_path / "config.json").write_text(json.dumps(conf))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(tmp_path / "ema.safetensors"),
    )
    from lmms_models._diffusion import encoders_of

    encoders_of(model)["vae"].save_pretrained(str(tmp_path / "vae"))
    again = spec.build(pretrained=str(tmp_path))
    enc = spec.pixel_encoder(again)
    px = torch.rand(3, 8, 12) * 2 - 1
    assert enc(px).shape == (4, 4, 6)  # VAE factor 2 on this tiny VAE
    assert spec.latent_decoder(again)(enc(px)).shape == (3, 8, 12)
    gen = [{"type": "text", "ids": [5, 6, 7], "loss": False}, {"type": "vae_gen", "pixels": px}]
    rows = [pack_samples([gen], again.config, start_of_image=1, end_of_image=2,
                         encode=spec.pixel_encoder(m)) for m in (model, again)]  # fmt: skip
    a, _, _ = cases.loss_grads(spec, model, rows[0])
    b, _, _ = cases.loss_grads(spec, again, rows[1])
    assert a == b


def _flux_ae_keys(ch: int, ch_mult: tuple[int, ...], n_res: int) -> set[str]:
    """Parameter names of FLUX's autoencoder (``flux/modules/autoencoder.py``: Encoder ``down``
    levels of ``n_res`` ResNet blocks, Decoder ``up`` levels of ``n_res + 1``, one mid attention
    of 1x1 convolutions), enumerated from that structure independently of the converter."""
    keys: set[str] = set()

    def conv(p: str) -> None:
        keys.update({p + ".weight", p + ".bias"})

    def res(p: str, c_in: int, c_out: int) -> None:
        for name in ("norm1", "conv1", "norm2", "conv2"):
            conv(f"{p}.{name}")
        if c_in != c_out:
            conv(f"{p}.nin_shortcut")

    def mid(p: str, c: int) -> None:
        res(f"{p}.mid.block_1", c, c)
        for name in ("norm", "q", "k", "v", "proj_out"):
            conv(f"{p}.mid.attn_1.{name}")
        res(f"{p}.mid.block_2", c, c)

    n = len(ch_mult)
    conv("encoder.conv_in")
    c_in = ch
    for i, m in enumerate(ch_mult):
        for j in range(n_res):
            res(f"encoder.down.{i}.block.{j}", c_in, ch * m)
            c_in = ch * m
        if i != n - 1:
            conv(f"encoder.down.{i}.downsample.conv")
    mid("encoder", c_in)
    conv("encoder.norm_out")
    conv("encoder.conv_out")
    conv("decoder.conv_in")
    c_in = ch * ch_mult[-1]
    mid("decoder", c_in)
    for i in reversed(range(n)):
        for j in range(n_res + 1):
            res(f"decoder.up.{i}.block.{j}", c_in, ch * ch_mult[i])
            c_in = ch * ch_mult[i]
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv")
    conv("decoder.norm_out")
    conv("decoder.conv_out")
    return keys


def test_flux_vae_layout_loads_into_diffusers_autoencoder(tmp_path):
    """FLUX-layout VAE weights (``ae.safetensors``) -> diffusers ``AutoencoderKL``: at FLUX's
    size the converter's names are exactly FLUX's (attention as [C, C, 1, 1] convolutions); a
    tiny random VAE written in FLUX names and read back into a differently initialised one
    encodes and decodes identically; a model config ``vae: <folder with ae.safetensors>``
    attaches it."""
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import save_file

    from lmms_models._diffusion import encoders_of
    from lmms_models.families.bagel import FLUX_VAE_CONFIG, diffusers_to_flux, load_flux_vae

    with torch.device("meta"):
        full = diffusers.AutoencoderKL(**FLUX_VAE_CONFIG)
    flux = diffusers_to_flux(full.state_dict())
    assert set(flux) == _flux_ae_keys(128, (1, 2, 4, 4), 2)
    assert flux["decoder.mid.attn_1.q.weight"].shape == (512, 512, 1, 1)
    assert flux["encoder.conv_out.weight"].shape == (32, 512, 3, 3)  # 2 x 16 latent channels

    tiny = dict(FLUX_VAE_CONFIG, block_out_channels=[32, 32, 64], latent_channels=4,
                down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                layers_per_block=1)  # fmt: skip
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKL(**tiny).eval()
    state = diffusers_to_flux(ref.state_dict())
    assert set(state) == _flux_ae_keys(32, (1, 1, 2), 1)
    folder = tmp_path / "flux_vae"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "ae.safetensors"))
    (folder / "ae_config.json").write_text(json.dumps(tiny))
    torch.manual_seed(1)  # a different initialisation, overwritten by the file
    vae = load_flux_vae(folder / "ae.safetensors", tiny)
    px = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        z_ref, z = ref.encode(px).latent_dist.mean, vae.encode(px).latent_dist.mean
        assert torch.equal(z, z_ref)
        assert torch.equal(vae.decode(z).sample, ref.decode(z_ref).sample)
    with pytest.raises(ValueError, match="not a FLUX autoencoder"):
        load_flux_vae(folder / "ae.safetensors", dict(tiny, latent_channels=8))

    spec = get_model_spec("bagel")
    model = spec.build(config={**spec.tiny_config(latent_channels=4), "vae": str(folder)})
    attached = encoders_of(model)["vae"]
    assert all(torch.equal(a, b) for a, b in zip(attached.state_dict().values(),
                                                 ref.state_dict().values(), strict=True))  # fmt: skip
    assert spec.pixel_encoder(model)(px[0]).shape == (4, 4, 4)  # factor 4 on this tiny VAE


def test_public_release_folder_builds(tmp_path):
    """The public release's folder (``llm_config.json`` + ``vit_config.json`` in Qwen2 / SigLIP
    keys, ``ema.safetensors``, FLUX ``ae.safetensors``; no config.json) builds with the authors'
    reading (ViT minus its last layer, QK-norm) and loads strictly; the trainer's FSDP2 load reads
    ``weights_file`` (ema.safetensors, not the VAE's file)."""
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import save_file

    from lmms_models._diffusion import encoders_of
    from lmms_models.families.bagel import FLUX_VAE_CONFIG, diffusers_to_flux

    spec = get_model_spec("bagel")
    tiny = spec.tiny_config()
    llm = {
        **tiny["llm"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "max_position_embeddings": 64,
    }
    llm.pop("qk_norm")
    vit = {**tiny["vit"], "num_hidden_layers": 3, "model_type": "siglip_vision_model"}
    (tmp_path / "llm_config.json").write_text(json.dumps(llm))
    (tmp_path / "vit_config.json").write_text(json.dumps(vit))
    conf = spec.pretrained_config(str(tmp_path))
    assert conf["vit"]["num_hidden_layers"] == 2 and conf["llm"]["qk_norm"] is True
    assert conf["latent_channels"] == 16 and conf["max_latent_size"] == 64
    torch.manual_seed(0)
    src = spec.build(config=conf)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()},
              str(tmp_path / "ema.safetensors"))  # fmt: skip
    ae = dict(FLUX_VAE_CONFIG, block_out_channels=[32, 32], layers_per_block=1,
              down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)  # fmt: skip
    vae = diffusers.AutoencoderKL(**ae)
    save_file({k: v.contiguous() for k, v in diffusers_to_flux(vae.state_dict()).items()},
              str(tmp_path / "ae.safetensors"))  # fmt: skip
    (tmp_path / "ae_config.json").write_text(json.dumps(ae))
    model = spec.build(pretrained=str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 src.state_dict().values(), strict=True))  # fmt: skip
    assert "vae" in encoders_of(model)
    assert spec.weights_file(str(tmp_path)).name == "ema.safetensors"
