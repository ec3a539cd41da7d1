"""Audio families: packed forward (varlen audio encoder, no 30 s padding) == Σ over samples of the
upstream model's own unpacked forward on padded windows (loss and gradients), FLOPs against the
modules' parameter counts, the dummy tower input, and the instance patch being scoped."""

from __future__ import annotations

import importlib

import pytest
import torch
from _parity import (
    assert_backends_match,
    assert_loss_matches,
    one_segment_loss,
    packed_step,
    reference_grads,
)

from lmms_models import get_model_spec
from lmms_models._audio import whisper_encoder_flops
from lmms_models.testing_audio import (
    AudioSampleSpec,
    OmniSampleSpec,
    audio_reference_loss_sum,
    make_audio_sample,
    make_omni_sample,
    pack_audio_samples,
)
from lmms_parallel.testing import full_grads

AUDIO_FAMILIES = ["qwen2_audio", "aero"]


def _samples():
    return [
        AudioSampleSpec(text=12),
        AudioSampleSpec(text=1, prompt=0),  # a length-1 sample
        AudioSampleSpec(text=6, audios=[[37]]),
        AudioSampleSpec(text=5, audios=[[100, 251], [5]]),  # a chunked audio, a 1-token audio
        AudioSampleSpec(text=3, audios=[[3000]]),  # the full window: the convolutions' edge
    ]


def audio_pack(name, reference_attn="sdpa"):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend=reference_attn)
    gen = torch.Generator().manual_seed(1)
    samples = [make_audio_sample(spec, model.config, s, gen=gen) for s in _samples()]
    total = sum(s["input_ids"].numel() for s in samples)
    return spec, model, samples, pack_audio_samples(spec, model, samples, pad_to=total + 3)


@pytest.mark.parametrize("name", AUDIO_FAMILIES)
def test_packed_matches_unpacked_upstream(name):
    spec, model, samples, batch = audio_pack(name)
    ref, n_ref = audio_reference_loss_sum(spec, model, samples)
    g_ref = reference_grads(model, ref)

    tower = spec.vision_tower(model)
    names = spec.set_attention(model, backend="varlen_sdpa")
    assert tower.config._attn_implementation == names["vision"]
    loss, count, g = packed_step(spec, model, batch)
    assert "forward" not in vars(tower)  # the varlen forward was only installed for the call
    assert_loss_matches(loss, count, ref, n_ref, batch)
    assert g.keys() == g_ref.keys()
    assert any("audio_tower.layers" in k for k in g) and any("projector" in k for k in g)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    # 3000 + 2*... frames would have been 5 windows of 3000 upstream: the pack keeps far fewer
    assert batch["input_features"].shape[0] == 39 + 102 + 253 + 7 + 3000

    # the check can fail: one text segment for the whole row changes the loss ...
    assert not torch.allclose(one_segment_loss(spec, model, batch), loss, rtol=1e-4)
    with (
        torch.no_grad()
    ):  # ... and so does reading the zero padding instead of the window's 2 context frames
        feats = batch["input_features"].clone()
        feats[37:39] = 0.0
        wrong, _ = spec.packed_forward(model, dict(batch, input_features=feats))
        assert not torch.allclose(wrong, loss, rtol=1e-6)
    with pytest.raises(ValueError, match="2 padding frames"):
        spec.packed_forward(model, dict(batch, audio_frames=batch["audio_feature_lens"]))
    with pytest.raises(ValueError, match="audio placeholder tokens do not match"):
        types = batch["mm_token_type_ids"].clone()
        types[types.nonzero()[0]] = 0
        spec.packed_forward(model, dict(batch, mm_token_type_ids=types))
    spec.set_attention(model, backend="varlen_sdpa", vision_backend="sdpa")
    with pytest.raises(NotImplementedError, match="varlen attention backend"):
        spec.packed_forward(model, batch)


@pytest.mark.parametrize("name", AUDIO_FAMILIES)
def test_dummy_audio_input_reaches_every_tower_parameter(name):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    tower = spec.vision_tower(model)
    with spec.media_context(model):
        out = tower(**spec.dummy_vision_inputs(model, torch.device("cpu")))
    assert out.shape == (1, model.config.text_config.hidden_size)  # projected: the text width
    out.sum().backward()
    # every parameter a real clip reaches, the projector included (FSDP2's reduce-scatters)
    reached = {k for k, p in model.named_parameters() if p.grad is not None}
    media = {
        k
        for k, p in model.named_parameters()
        if p.requires_grad and ("audio_tower" in k or "projector" in k)
    }
    assert reached == media


@pytest.mark.parametrize("name", AUDIO_FAMILIES)
def test_audio_flops_match_module_parameters(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    ac = model.config.audio_config
    tower = spec.vision_tower(model)
    proj = sum(p.numel() for p in spec.projector(model).parameters())
    n_conv1 = sum(p.numel() for p in tower.conv1.parameters())
    per_pos = sum(
        p.numel() for n, p in tower.named_parameters() if n.startswith(("conv2", "layers"))
    )
    per_out = sum(p.numel() for p in tower.layer_norm.parameters()) + proj
    lens = torch.tensor([37, 3000])  # 19 + 1500 positions, 9 + 750 tokens
    want = 6 * (n_conv1 * 3037 + per_pos * 1519 + per_out * 759)
    want += 12 * ac.encoder_layers * ac.d_model * (19**2 + 1500**2)
    hidden = model.config.text_config.hidden_size
    assert whisper_encoder_flops(ac, lens, out_hidden=hidden) == pytest.approx(want)
    assert spec.media_flops(model.config, {"audio_feature_lens": lens}) == pytest.approx(want)
    lm = sum(p.numel() for p in spec.text_model(model).parameters())
    lm += sum(p.numel() for p in spec.lm_head(model).parameters())
    assert spec.lm_matmul_params(model.config) == lm - spec.embeddings(model)[0].weight.numel()


@pytest.mark.parametrize("name", AUDIO_FAMILIES)
def test_build_meta_and_hooks(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert len(spec.decoder_blocks(model)) == spec.text_config(model.config).num_hidden_layers
    assert spec.sp_slice_module(model) is spec.text_model(model)
    tower = spec.vision_tower(model)  # the audio tower takes the vision tower's part
    assert tower is spec.audio_tower(model)
    assert spec.vision_blocks(model) == list(tower.layers)
    assert len(spec.vision_blocks(model)) == model.config.audio_config.encoder_layers
    assert len(spec.block_classes(model)) == 2
    assert spec.processor_family == "qwen2_audio"  # Aero reads Qwen2-Audio's features


def _omni_samples():
    return [
        OmniSampleSpec(text=10, prompt=2),
        OmniSampleSpec(text=1, prompt=0),  # a length-1 sample
        OmniSampleSpec(text=4, images=[(1, 4, 4)], audios=[150]),
        # video + its own sound track, interleaved in 2 s chunks (3 temporal patches of 1.25 s),
        # then an image and a standalone audio: every modality in one sample
        OmniSampleSpec(
            text=3,
            videos=[(3, 4, 4)],
            video_audio=[370],
            images=[(1, 2, 6)],
            audios=[45],
            second_per_grid=1.25,
        ),
        OmniSampleSpec(text=5, videos=[(2, 2, 2)], audios=[250]),  # video without its audio
    ]


def omni_pack(reference_attn="sdpa"):
    torch.manual_seed(0)
    spec = get_model_spec("qwen2_5_omni")
    model = spec.build(config=spec.tiny_config(), attn_backend=reference_attn)
    gen = torch.Generator().manual_seed(1)
    samples = [make_omni_sample(spec, model.config, s, gen=gen) for s in _omni_samples()]
    total = sum(s["input_ids"].numel() for s in samples)
    return spec, model, samples, pack_audio_samples(spec, model, samples, pad_to=total + 3)


def test_omni_packed_matches_unpacked_upstream():
    """Qwen2.5-Omni thinker: packs mixing text, image, video, audio and video-with-audio
    (TMRoPE positions from upstream's get_rope_index per sample) == upstream unpacked."""
    spec, model, samples, batch = omni_pack()
    ref, n_ref = audio_reference_loss_sum(spec, model, samples)
    g_ref = reference_grads(model, ref)
    spec.set_attention(model, backend="varlen_sdpa")
    assert spec.audio_tower(model).config._attn_implementation.startswith("lmms_flash_vision")
    loss, count, g = packed_step(spec, model, batch)
    assert_loss_matches(loss, count, ref, n_ref, batch)
    assert g.keys() == g_ref.keys()
    for part in ("audio_tower.layers", "audio_tower.proj", "visual.blocks", "embed_tokens"):
        assert any(part in k for k in g), part
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    # positions are TMRoPE, not plain: the video-with-audio sample's rows differ from arange
    pos = batch["position_ids"]
    assert not torch.equal(pos[1], pos[0]) and not torch.equal(pos[2], pos[3])
    with torch.no_grad():  # the check can fail: text positions instead of TMRoPE
        flat = dict(batch, position_ids=batch["position_ids"][0].expand(4, -1).clone())
        wrong, _ = spec.packed_forward(model, flat)
        assert not torch.allclose(wrong, loss, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_omni_audio_inputs_precomputed_on_the_host(name, monkeypatch):
    """The Omni audio towers get their chunking, valid indices and (window) cu_seqlens computed
    on the host (no device reads on a GPU); the step is bit-identical to the tower deriving them
    itself."""
    spec, model, _, batch = omni_pack() if name == "qwen2_5_omni" else omni3_pack(aux=False)
    spec.set_attention(model, backend="varlen_sdpa")
    seen: list[bool] = []
    spec.audio_tower(model).register_forward_pre_hook(
        lambda _m, _a, kw: seen.append("valid_indices" in kw), with_kwargs=True
    )

    loss, _, grads = packed_step(spec, model, batch)
    assert seen == [True]
    monkeypatch.setattr(spec, "host_audio_inputs", lambda *_a: {})
    ref_loss, _, ref_grads = packed_step(spec, model, batch)
    assert seen == [True, False]
    assert torch.equal(loss, ref_loss)
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), k


def test_omni_hooks_and_flops():
    from lmms_models.families.qwen2_5_omni import omni_audio_flops

    spec = get_model_spec("qwen2_5_omni")
    model = spec.build(config=spec.tiny_config(), device="meta")
    tower, visual = spec.audio_tower(model), spec.vision_tower(model)
    assert spec.vision_blocks(model) == [*visual.blocks, *tower.layers]  # FSDP2 / AC units
    assert len(spec.block_classes(model)) == 3
    ac = model.config.audio_config
    n = lambda mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    p = spec.vision_matmul_params(model.config)  # the Qwen2.5-VL count fits its ViT
    assert p["per_patch"] + p["per_merged"] == n([visual])
    lens = torch.tensor([37, 450])  # chunks of 200 frames: [37], [200, 200, 50]
    after = [19, 225]
    want = 6 * (n([tower.conv1]) * 487 + n([tower.conv2, tower.layers]) * sum(after))
    want += 6 * n([tower.ln_post, tower.proj]) * (9 + 112)
    want += 12 * ac.encoder_layers * ac.d_model * (19**2 + 2 * 100**2 + 25**2)
    assert omni_audio_flops(ac, lens) == pytest.approx(want)
    grid = torch.tensor([[1, 4, 4]])
    batch = {"image_grid_thw": grid, "audio_feature_lens": lens}
    assert spec.media_flops(model.config, batch) == pytest.approx(
        want + spec.vision_flops(model.config, grid)
    )
    lm = [*spec.text_model(model).named_parameters(), *spec.lm_head(model).named_parameters()]
    assert spec.lm_matmul_params(model.config) == sum(
        p.numel() for k, p in lm if "embed_tokens" not in k
    )


def test_aero_checkpoint_layout_round_trip(tmp_path):
    """Aero saves and loads with the public checkpoint's parameter names."""
    from safetensors import safe_open

    spec = get_model_spec("aero")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"audio_tower.conv1.weight", "audio_tower.layers.0.self_attn.q_proj.weight",
            "audio_modal_projector.linear.weight", "audio_modal_projector.linear.bias",
            "language_model.model.layers.0.self_attn.q_proj.weight",
            "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"} <= keys  # fmt: skip
    assert all(
        k.split(".")[0] in ("audio_tower", "audio_modal_projector", "language_model") for k in keys
    )
    loaded = spec.build(pretrained=str(tmp_path), attn_backend="varlen_sdpa")
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    assert spec.build(pretrained=str(tmp_path), device="meta").language_model.lm_head.weight.is_meta


def _omni3_samples():
    return [
        OmniSampleSpec(text=10, prompt=2),
        OmniSampleSpec(text=1, prompt=0),  # a length-1 sample
        OmniSampleSpec(text=4, images=[(1, 4, 4)], audios=[150]),  # a 2-chunk clip
        # a video with its own sound track (use_audio_in_video: interleaved token by token;
        # 0.5 s per temporal patch: fractional TMRoPE times, 6.5 at 13 per second), an image,
        # clips of 45, 8 (one token) and 120 frames: every modality in one sample. Every audio
        # sample has a full 100-frame chunk: upstream pads chunks to its batch's longest, which
        # moves the edge frames of shorter chunks (~1e-5 on the first convolution's bias
        # gradient); a pack pads to the pack's longest.
        OmniSampleSpec(
            text=3,
            videos=[(2, 4, 4)],
            video_audio=[230],
            images=[(1, 2, 6)],
            audios=[45, 8, 120],
            second_per_grid=0.5,
        ),
        # a video without its sound (0.75 s per patch: 9.75), a standalone clip
        OmniSampleSpec(text=5, videos=[(2, 2, 2)], audios=[250], second_per_grid=0.75),
    ]


def omni3_pack(aux: bool, samples=None):
    torch.manual_seed(0)
    spec = get_model_spec("qwen3_omni_moe")
    moe = {"output_router_logits": aux, "router_aux_loss_coef": 0.01}
    model = spec.build(config=spec.tiny_config(text_config=moe), attn_backend="sdpa")
    gen = torch.Generator().manual_seed(1)
    made = [make_omni_sample(spec, model.config, s, gen=gen) for s in samples or _omni3_samples()]
    total = sum(s["input_ids"].numel() for s in made)
    return spec, model, made, pack_audio_samples(spec, model, made, pad_to=total + 3)


@pytest.mark.parametrize("experts", ["eager", "grouped"])
def test_omni3_packed_matches_unpacked_upstream(experts):
    """Qwen3-Omni-MoE thinker: a pack of text, image, video and audio samples (audio tower on
    host-precomputed chunks and windows, deepstack at host positions, routed experts) ==
    upstream's unpacked thinker, loss and every gradient."""
    spec, model, samples, batch = omni3_pack(aux=False)
    ref, n_ref = audio_reference_loss_sum(spec, model, samples)
    g_ref = reference_grads(model, ref)
    spec.set_attention(model, backend="varlen_sdpa")
    spec.set_experts(model, experts)
    loss, count, g = packed_step(spec, model, batch)
    assert_loss_matches(loss, count, ref, n_ref, batch)
    assert g.keys() == g_ref.keys()
    for part in ("audio_tower.layers", "audio_tower.conv2d1", "visual.merger_list",
                 "mlp.experts", "mlp.gate"):  # fmt: skip
        assert any(part in k for k in g), part
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-5, msg=k)  # grads ~1-10
    pos = batch["position_ids"]  # float32, fractional where the videos are (kept, not rounded)
    assert pos.dtype == torch.float32 and bool((pos % 1 != 0).any())
    ids, types = batch["input_ids"], batch["mm_token_type_ids"]
    cfg = model.config
    opens = (ids[:-1] == cfg.vision_start_token_id) & (ids[1:] == cfg.audio_start_token_id)
    video_block = types[int(opens.nonzero()[0]) :][:60]  # the video with its sound track
    assert ((video_block[1:] == 2) & (video_block[:-1] == 3)).any()  # audio then video ...
    assert ((video_block[1:] == 3) & (video_block[:-1] == 2)).any()  # ... token by token
    with torch.no_grad():  # the check can fail: positions rounded as Qwen2.5-Omni's
        wrong, _ = spec.packed_forward(model, dict(batch, position_ids=pos.floor()))
        assert not torch.allclose(wrong, loss, rtol=1e-6)


def test_omni3_router_aux_loss_matches_upstream():
    """One image + audio + video sample with the router aux loss on: the packed loss is
    upstream's ``loss + coef · aux`` (the aux is per pack, so one sample is the exact
    reference), gradients included."""
    one = [OmniSampleSpec(text=6, images=[(1, 4, 4)], videos=[(2, 2, 2)], audios=[150],
                          second_per_grid=2.0)]  # fmt: skip
    spec, model, samples, batch = omni3_pack(aux=True, samples=one)
    s = samples[0]
    out = model(input_ids=s["input_ids"][None], labels=s["labels"][None], use_cache=False,
                **s["ref_kwargs"])  # fmt: skip
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0.5
    out.loss.backward()
    g_ref = full_grads(model)
    model.zero_grad(set_to_none=True)
    spec.set_attention(model, backend="varlen_sdpa")
    loss, n = spec.packed_forward(model, batch)
    (loss / n).backward()
    torch.testing.assert_close(loss.detach() / n, out.loss.detach(), rtol=1e-5, atol=1e-6)
    lm_only = out.loss.detach() - 0.01 * out.aux_loss.detach()
    assert abs(float(loss.detach() / n - lm_only)) > 1e-4  # the aux term is really in it
    g = full_grads(model)
    assert g.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-5, msg=k)  # grads ~1-10


def test_omni3_hooks_tokens_and_flops():
    from lmms_models.families.qwen3_omni_moe import omni3_audio_tokens

    spec = get_model_spec("qwen3_omni_moe")
    model = spec.build(config=spec.tiny_config(), device="meta")
    tower, visual = spec.audio_tower(model), spec.vision_tower(model)
    assert spec.vision_blocks(model) == [*visual.blocks, *tower.layers]
    assert spec.audio_tower(model).positional_embedding.positional_embedding.device.type == "cpu"
    lens = torch.tensor([8, 45, 100, 150, 250, 1000])
    upstream = importlib.import_module(type(tower).__module__)._get_feat_extract_output_lengths
    assert torch.equal(omni3_audio_tokens(lens, 50), upstream(lens, 50))
    assert omni3_audio_tokens(lens, 50).tolist() == [1, 6, 13, 20, 33, 130]
    grid = torch.tensor([[1, 4, 4]])
    vision = spec.media_flops(model.config, {"image_grid_thw": grid})
    both = spec.media_flops(model.config, {"image_grid_thw": grid, "audio_feature_lens": lens})
    assert vision == pytest.approx(spec.vision_flops(model.config, grid)) and both > vision
    n = lambda mods: sum(p.numel() for m in mods for p in m.parameters() if p.dim() > 1)  # noqa: E731
    # 6 · (matrix parameters outside the convolutions) per output token: the lower bound
    assert both - vision > 6 * n([tower.layers, tower.conv_out, tower.proj1, tower.proj2]) * 203


def _save_full_omni(name, folder):
    """A tiny full Omni model (thinker + talker + speech decoder) saved as the releases are."""
    import transformers

    spec = get_model_spec(name)
    small = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)  # fmt: skip
    if name == "qwen2_5_omni":
        ids = {k: v for k, v in spec.tiny_config().items() if k.endswith("_id")}
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
        talker = dict(small, vocab_size=64, embedding_size=64, rope_parameters=rope, **ids)
        talker = {k.replace("_token_id", "_token_index") if k in ("image_token_id", "video_token_id",
                  "audio_token_id") else k: v for k, v in talker.items()}  # fmt: skip
        speech = {"token2wav_config": {
            "dit_config": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                               emb_dim=16, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 32],
                               enc_attention_channels=8, enc_se_channels=8, num_embeds=64,
                               look_ahead_layers=[0], look_backward_layers=[0]),
            "bigvgan_config": dict(upsample_initial_channel=16, resblock_kernel_sizes=[3],
                                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2],
                                   upsample_kernel_sizes=[4])}}  # fmt: skip
        cls, conf = transformers.Qwen2_5OmniForConditionalGeneration, transformers.Qwen2_5OmniConfig
    else:
        text = dict(small, vocab_size=64, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                    shared_expert_intermediate_size=16)  # fmt: skip
        talker = dict(text_config=text, code_predictor_config=dict(small, vocab_size=32, num_code_groups=2),
                      thinker_hidden_size=64, num_code_groups=2, accept_hidden_layer=1,
                      spatial_merge_size=2)  # fmt: skip
        speech = {"code2wav_config": dict(small, codebook_size=32, num_quantizers=2, decoder_dim=32,
                                          upsample_rates=[2], upsampling_ratios=[2], sliding_window=4)}  # fmt: skip
        cls, conf = (
            transformers.Qwen3OmniMoeForConditionalGeneration,
            transformers.Qwen3OmniMoeConfig,
        )
    torch.manual_seed(0)
    full = cls(conf(thinker_config=spec.tiny_config(), talker_config=talker, enable_audio_output=True,
                    **speech))  # fmt: skip
    full.save_pretrained(folder)
    return spec, full


@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_full_omni_checkpoint_loads_the_thinker(name, tmp_path, capsys):
    """A released-layout full Omni folder (``thinker.``/``talker.``/speech-decoder weights;
    Qwen3-Omni's experts saved per expert) builds the family's thinker with the thinker's
    weights, one line naming what was left out; the FSDP2 path's rank-0 weights are the same;
    the export writes the thinker alone and loads back."""
    from lmms_parallel import export_hf, load_full_state_dict, materialize

    spec, full = _save_full_omni(name, tmp_path / "full")
    want = full.thinker.state_dict()
    capsys.readouterr()  # transformers' notes on the tiny talker's config
    model = spec.build(pretrained=str(tmp_path / "full"), attn_backend="varlen_sdpa")
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and "full Omni checkpoint" in line[0] and "talker.*" in line[0]
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the trainer's FSDP2 path: built on meta, rank 0's weights from the family
    meta = spec.build(pretrained=str(tmp_path / "full"), device="meta")
    materialize(meta, torch.device("cpu"))
    load_full_state_dict(meta, spec.pretrained_weights(str(tmp_path / "full")))
    for k, v in meta.state_dict().items():
        assert torch.equal(v, want[k]), k
    out = export_hf(model, tmp_path / "hf")
    conf = __import__("json").loads((out / "config.json").read_text())
    assert conf["model_type"] == f"{name}_thinker" and "talker_config" not in conf
    capsys.readouterr()
    again = spec.build(pretrained=str(out), attn_backend="varlen_sdpa")
    assert "lmms-models" not in capsys.readouterr().err  # a thinker folder: nothing left out
    for k, v in again.state_dict().items():
        assert torch.equal(v, want[k]), k
    # a run from the full folder: the export becomes the release's layout again (with the
    # files the full model reads beside its weights: Qwen2.5-Omni's speaker table)
    torch.save({"Chelsie": {"bos_token": 1}}, tmp_path / "full" / "spk_dict.pt")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # "trained"
    want = model.state_dict()
    out = export_hf(model, tmp_path / "hf_full")
    spec.finish_export(out, str(tmp_path / "full"))
    back = type(full).from_pretrained(str(out), local_files_only=True)
    for k, v in back.thinker.state_dict().items():
        assert torch.equal(v, want[k]), k
    speech = {k: v for k, v in full.state_dict().items() if not k.startswith("thinker.")}
    got = back.state_dict()
    assert speech and all(torch.equal(got[k], v) for k, v in speech.items())
    assert (out / "spk_dict.pt").is_file() and "lmms-models" in capsys.readouterr().err
    (tmp_path / "full" / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="model_type 'qwen2'"):
        spec.build(pretrained=str(tmp_path / "full"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*AUDIO_FAMILIES, "qwen2_5_omni", "qwen3_omni_moe"])
def test_audio_packed_matches_unpacked_on_gpu(name):
    """The real kernels (bf16 autocast, every available flash backend, head dim 64 in the
    decoder and 32 in the towers) against the unpacked reference on the GPU."""
    import lmms_kernels

    spec = get_model_spec(name)
    torch.manual_seed(0)
    text = {"num_attention_heads": 1, "num_key_value_heads": 1}
    if name == "qwen3_omni_moe":
        text["head_dim"] = 64
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [12, 10, 10],
            "mrope_interleaved": True,
        }
    if name == "qwen2_5_omni":
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [16, 8, 8],
        }
    cfg = spec.tiny_config(text_config=text, audio_config={"encoder_attention_heads": 1})
    model = spec.build(config=cfg, device="cuda", attn_backend="sdpa")
    gen = torch.Generator().manual_seed(1)
    if name == "qwen2_5_omni":
        samples = [make_omni_sample(spec, model.config, s, gen=gen) for s in _omni_samples()]
    elif name == "qwen3_omni_moe":
        samples = [make_omni_sample(spec, model.config, s, gen=gen) for s in _omni3_samples()]
    else:
        samples = [make_audio_sample(spec, model.config, s, gen=gen) for s in _samples()]
    batch = pack_audio_samples(spec, model, samples, pad_to=0)
    to_cuda = lambda x: x.cuda() if torch.is_tensor(x) else x  # noqa: E731
    cuda = [{k: ({kk: to_cuda(vv) for kk, vv in v.items()} if isinstance(v, dict) else to_cuda(v))
             for k, v in s.items()} for s in samples]  # fmt: skip
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref, n = audio_reference_loss_sum(spec, model, cuda)
    backends = [b for b in lmms_kernels.available_backends() if b in ("fa4", "fa", "torch", "flex")]
    assert_backends_match(spec, model, batch, ref, n, backends)
