"""Audio families: packed forward (varlen audio encoder, no 30 s padding) == Σ over samples of the
upstream model's own unpacked forward on padded windows (loss and gradients), FLOPs against the
modules' parameter counts, the dummy tower input, and the instance patch being scoped."""

from __future__ import annotations

import pytest
import torch

from lmms_models import get_model_spec
from lmms_models._audio import whisper_encoder_flops
from lmms_models.testing_audio import (
    AudioSampleSpec,
    audio_reference_loss_sum,
    make_audio_sample,
    pack_audio_samples,
)

AUDIO_FAMILIES = ["qwen2_audio"]


def _samples():
    return [
        AudioSampleSpec(text=12),
        AudioSampleSpec(text=1, prompt=0),  # a length-1 sample
        AudioSampleSpec(text=6, audios=[[37]]),
        AudioSampleSpec(text=5, audios=[[100, 251], [5]]),  # a chunked audio, a 1-token audio
        AudioSampleSpec(text=3, audios=[[3000]]),  # the full window: the convolutions' edge
    ]


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


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
    ref.backward()
    g_ref = _grads(model)
    model.zero_grad(set_to_none=True)

    tower = spec.vision_tower(model)
    names = spec.set_attention(model, backend="varlen_sdpa")
    assert tower.config._attn_implementation == names["vision"]
    loss, count = spec.packed_forward(model, batch)
    loss.backward()
    g = _grads(model)
    assert "forward" not in vars(tower)  # the varlen forward was only installed for the call
    assert int(count) == n_ref == batch["num_loss_tokens"]
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys()
    assert any("audio_tower.layers" in k for k in g) and any("projector" in k for k in g)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    # 3000 + 2*... frames would have been 5 windows of 3000 upstream: the pack keeps far fewer
    assert batch["input_features"].shape[0] == 39 + 102 + 253 + 7 + 3000

    # the check can fail: one text segment for the whole row changes the loss ...
    with torch.no_grad():
        bad = dict(
            batch, cu_seqlens=torch.tensor([0, batch["input_ids"].numel()], dtype=torch.int32)
        )
        bad["max_seqlen"] = batch["input_ids"].numel()
        wrong, _ = spec.packed_forward(model, bad)
        assert not torch.allclose(wrong, loss, rtol=1e-4)
        # ... and so does reading the zero padding instead of the window's 2 context frames
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
    proj = sum(p.numel() for p in spec.base_model(model).multi_modal_projector.parameters())
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
    assert spec.lm_matmul_params(model.config) == sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.startswith(("model.language_model", "lm_head")) and "embed_tokens" not in n
    )


@pytest.mark.parametrize("name", AUDIO_FAMILIES)
def test_build_meta_and_hooks(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert len(spec.decoder_blocks(model)) == spec.text_config(model.config).num_hidden_layers
    assert spec.sp_slice_module(model) is spec.text_model(model)
    tower = spec.vision_tower(model)  # the audio tower takes the vision tower's part
    assert tower is spec.base_model(model).audio_tower
    assert spec.vision_blocks(model) == list(tower.layers)
    assert len(spec.vision_blocks(model)) == model.config.audio_config.encoder_layers
    assert len(spec.block_classes(model)) == 2
    assert spec.processor_family == name
