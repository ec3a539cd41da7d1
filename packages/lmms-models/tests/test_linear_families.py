"""Linear-attention families (Qwen3.5, Qwen3.5-MoE, flash-linear-attention's Gated DeltaNet):
packed == unpacked (loss, gradients) with a sample ending mid-chunk past one chunk, a length-1
sample, images and video, tail padding; no state leak between samples of a pack; the packed
mixers come off bit for bit; FLOPs counts against the built modules.

Qwen3.5's reference is transformers' own unpacked forward (its torch fallbacks on CPU). The fla
family's layers run Triton only, so on CPU its reference is each sample alone through the same
model (one segment per call); the GPU test compares against fla's own layers.
"""

from __future__ import annotations

import pytest
import torch
from _parity import assert_loss_matches, one_segment_loss, packed_step, padded_pack, reference_grads

from lmms_models import get_model_spec
from lmms_models._linear_attention import LinearMixerHandle
from lmms_models._linear_spec import delta_rule_flops_per_token
from lmms_models.testing import SampleSpec, make_sample, pack_samples, reference_loss_sum
from lmms_parallel.testing import full_grads

QWEN_FAMILIES = ["qwen3_5", "qwen3_5_moe"]
FLA_FAMILIES = ["fla_gated_deltanet"]
LINEAR_FAMILIES = QWEN_FAMILIES + FLA_FAMILIES


def _samples(spec, model, seed=1):
    # 75 tokens: past one 64-token chunk, ending mid-chunk; a length-1 sample; media samples
    ss = [SampleSpec(text=75), SampleSpec(text=1, prompt=0), SampleSpec(text=7, prompt=3)]
    if "pixel_values" in spec.media_keys:
        ss += [
            SampleSpec(text=6, images=[(1, 4, 4), (1, 2, 6)]),
            SampleSpec(text=5, videos=[(2, 4, 4)]),
        ]
    gen = torch.Generator().manual_seed(seed)
    return [make_sample(spec, model.config, s, gen=gen) for s in ss]


def _fla_reference(spec, model, samples):
    """Σ over samples of each sample alone (one segment) through the packed forward."""
    total, count = torch.zeros(()), 0
    for s in samples:
        loss, n = spec.packed_forward(model, pack_samples(spec, model, [s]))
        total, count = total + loss, count + int(n)
    return total, count


@pytest.mark.parametrize("name", LINEAR_FAMILIES)
def test_packed_matches_unpacked(name):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    upstream = name in QWEN_FAMILIES
    model = spec.build(
        config=spec.tiny_config(), attn_backend="sdpa" if upstream else "varlen_sdpa"
    )
    samples = _samples(spec, model)
    if upstream:
        ref, n_ref = reference_loss_sum(spec, model, samples)
    else:
        ref, n_ref = _fla_reference(spec, model, samples)
    g_ref = reference_grads(model, ref)
    batch = padded_pack(spec, model, samples)
    names = spec.set_attention(model, backend="varlen_sdpa")
    assert names["linear"] == "lmms_auto"
    loss, count, g_packed = packed_step(spec, model, batch)
    assert_loss_matches(loss, count, ref, n_ref, batch)
    assert g_packed.keys() == g_ref.keys()
    assert any("A_log" in k for k in g_packed) and any("conv1d" in k for k in g_packed)
    for k in g_ref:
        scale = g_ref[k].abs().max().clamp_min(1e-3)
        torch.testing.assert_close(g_packed[k] / scale, g_ref[k] / scale, rtol=0, atol=1e-4, msg=k)
    # the check can fail: one segment for the whole row carries state across samples
    assert not torch.allclose(one_segment_loss(spec, model, batch), loss, rtol=1e-4)


def _last_hidden(spec, model, batch):
    seen = []
    hook = spec.text_model(model).register_forward_hook(
        lambda _m, _a, out: seen.append(out.last_hidden_state.detach())
    )
    try:
        with torch.no_grad():
            spec.packed_forward(model, batch)
    finally:
        hook.remove()
    return seen[0][0]  # [T, H]


@pytest.mark.parametrize("name", LINEAR_FAMILIES)
def test_no_state_leak_between_samples(name):
    """Changing sample A moves none of sample B's outputs in the same pack (every layer: conv,
    recurrence, softmax attention); with one segment (the leak) it does."""
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    gen = torch.Generator().manual_seed(5)
    a, b = (make_sample(spec, model.config, SampleSpec(text=n), gen=gen) for n in (70, 20))
    a2 = dict(a, input_ids=torch.randint(0, 1000, a["input_ids"].shape, generator=gen))
    h1 = _last_hidden(spec, model, pack_samples(spec, model, [a, b]))
    h2 = _last_hidden(spec, model, pack_samples(spec, model, [a2, b]))
    assert not torch.allclose(h1[:70], h2[:70])
    torch.testing.assert_close(h1[70:], h2[70:], rtol=0, atol=1e-6)
    one = dict(
        pack_samples(spec, model, [a2, b]), cu_seqlens=torch.tensor([0, 90], dtype=torch.int32)
    )
    h3 = _last_hidden(spec, model, one)
    assert not torch.allclose(h3[70:], h1[70:], atol=1e-3)


def test_mixers_come_off_bit_for_bit():
    """Switching to lmms' mixers and back leaves the upstream model's output bit-identical; the
    handle of an installation removes it."""
    torch.manual_seed(0)
    spec = get_model_spec("qwen3_5")
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    ids = torch.randint(0, 1000, (1, 20))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        spec.set_attention(model, backend="varlen_sdpa")
        assert all("forward" in vars(m) for m in spec.linear_mixers(model))
        spec.set_attention(model, backend="sdpa")
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    handle = spec.set_linear_backend(model, "torch")
    assert all(m._lmms_mixer.backend == "torch" for m in spec.linear_mixers(model))
    handle.remove()
    assert not any("forward" in vars(m) for m in spec.linear_mixers(model))
    LinearMixerHandle(spec.linear_mixers(model)).remove()  # idempotent


def test_sp_cover_adds_the_padding_segment_once_per_pack():
    """Under SP the padding tail is a segment of its own; every layer of a pack gets the same
    covered tensor (one host read per pack)."""
    from lmms_parallel._sp_plans import _cover  # the sp_linear_heads style's

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    assert torch.equal(_cover(cu, 12), torch.tensor([0, 5, 9, 12], dtype=torch.int32))
    assert _cover(cu, 12) is _cover(cu, 12) and _cover(cu, 9) is cu
    with pytest.raises(ValueError, match="ends at 9"):
        _cover(cu, 8)


def _params(module, skip=()):
    return sum(p.numel() for n, p in module.named_parameters() if not any(s in n for s in skip))


@pytest.mark.parametrize("name", LINEAR_FAMILIES)
def test_flops_params_match_module(name):
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="meta")
    if name == "qwen3_5_moe":
        cfg = spec.text_config(model.config)
        inactive = cfg.num_hidden_layers * (4 - 2) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    else:
        inactive = 0
    expected = _params(model, skip=("embed_tokens", "embeddings", "visual")) - inactive
    assert spec.lm_matmul_params(model.config) == expected
    if spec.vision_tower(model) is not None:
        p = spec.vision_matmul_params(model.config)
        assert p["per_patch"] + p["per_merged"] == _params(
            spec.vision_tower(model), skip=("pos_embed",)
        )


def test_presets_are_the_published_shapes():
    """``qwen3_5`` ``2b`` and ``qwen3_5_moe`` ``35b_a3b`` build (meta) to Qwen3.5-2B's and
    Qwen3.5-35B-A3B's sizes; the MoE preset's experts split evenly over 8 EP ranks."""
    sizes = {  # (total parameters, active LM matmul parameters) bounds
        ("qwen3_5", "2b"): ((2.15e9, 2.3e9), (1.85e9, 1.95e9)),
        ("qwen3_5_moe", "35b_a3b"): ((34.5e9, 35.5e9), (2.9e9, 3.0e9)),
    }
    for (name, preset), ((lo, hi), (alo, ahi)) in sizes.items():
        spec = get_model_spec(name)
        model = spec.build(config=spec.preset(preset), device="meta")
        cfg = spec.text_config(model.config)
        assert lo < _params(model) < hi, name
        assert alo < spec.lm_matmul_params(model.config) < ahi, name
        assert cfg.layer_types.count("full_attention") * 4 == cfg.num_hidden_layers, name
        assert spec.vision_tower(model).config.out_hidden_size == cfg.hidden_size, name
    assert cfg.num_experts % 8 == 0 and spec.ep_plan == {"layers.*.mlp.experts": "experts"}


def test_lm_flops_hybrid_hand_count():
    """Qwen3.5 tiny: 2 linear layers (4 value heads, Dk = Dv = 16), 1 softmax layer (4 x 16)."""
    spec = get_model_spec("qwen3_5")
    cfg = spec.make_config(spec.tiny_config())
    lens = [70, 1, 9]
    n = spec.lm_matmul_params(cfg)
    per_head = 64 * (6 * 16 + 4 * 16) + 6 * 16 * 16 + 2 * 64**2 / 3
    lin = 2 * 3 * 4 * per_head * 80
    attn = 12 * 1 * 64 * (70**2 + 1 + 81)
    assert delta_rule_flops_per_token(4, 16, 16) == 3 * 4 * per_head
    assert spec.lm_flops(cfg, lens) == pytest.approx(6 * n * 80 + attn + lin)
    assert spec.lm_flops(cfg, lens, causal_half=True) == pytest.approx(6 * n * 80 + attn / 2 + lin)


def test_hooks_of_the_fla_family():
    spec = get_model_spec("fla_gated_deltanet")
    model = spec.build(config=spec.tiny_config(), device="meta")
    assert len(spec.decoder_blocks(model)) == 2 == len(spec.linear_mixers(model))
    assert spec.embeddings(model)[0] is model.model.embeddings
    assert spec.vision_tower(model) is None and spec.vision_blocks(model) == []
    assert spec.sp_slice_module(model) is model.model
    with pytest.raises(NotImplementedError, match="hybrid"):
        spec.make_config(spec.tiny_config(attn={"layers": [1], "num_heads": 2}))


def _compiled_matches_eager(name, device, linear_backend, compile_backend, ac):
    """Loss and gradients of two packs of different lengths through the packed forward, eager
    and with the decoder blocks compiled as ``trainer_args.compile`` does (dynamic shapes, after
    activation checkpointing when ``ac``); the compiled blocks are removed afterwards."""
    from torch._dynamo.utils import counters

    import lmms_kernels as lk
    import lmms_parallel as lp

    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa").to(device)
    spec.set_linear_backend(model, linear_backend)
    samples = _samples(spec, model)
    # host batches: packed_forward moves what the model needs (host keys stay on the host)
    packs = [pack_samples(spec, model, samples), pack_samples(spec, model, samples[:3])]

    def run():
        out = []
        for batch in packs:
            model.zero_grad(set_to_none=True)
            loss, count = spec.packed_forward(model, batch)
            (loss / count).backward()
            out.append((loss.detach(), full_grads(model)))
        return out

    eager = run()
    blocks = spec.decoder_blocks(model)
    ac = lp.apply_activation_checkpointing(blocks, "full") if ac else None
    torch._dynamo.reset()
    counters.clear()
    handle = lk.compile_blocks(blocks, backend=compile_backend)
    try:
        compiled = run()
        graphs, breaks = lk.compile_counts()["graphs"], lk.compile_counts()["graph_breaks"]
    finally:
        handle.remove()
        if ac is not None:
            ac.remove()
    assert graphs > 0
    if name != "qwen3_5_moe":  # (the routed experts' token counts are data-dependent)
        assert breaks == 0, counters["graph_break"]
    for (loss_e, g_e), (loss_c, g_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4)
        assert g_c.keys() == g_e.keys()
        for k, g in g_e.items():
            scale = g.abs().max().clamp_min(1e-3)
            err = float((g_c[k] - g).abs().max() / scale)
            assert err < 1e-3, (k, err)


def test_compiled_blocks_match_eager_on_cpu():
    """CPU, the torch reference path: flash-linear-attention's Gated DeltaNet blocks under
    ``torch.compile`` (aot_eager, dynamic shapes) inside full activation checkpointing compile
    whole (no graph break) and equal eager (the GPU test runs Inductor on fla's kernels)."""
    _compiled_matches_eager("fla_gated_deltanet", "cpu", "torch", "aot_eager", ac=True)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "full_ac"])
@pytest.mark.parametrize("name", LINEAR_FAMILIES)
def test_gpu_compiled_blocks_on_fla_kernels_match_eager(name, ac):
    """``torch.compile`` (Inductor, dynamic shapes) of the decoder blocks with the packed mixers
    on flash-linear-attention's kernels (custom ops in the graphs: lmms_kernels._linear_ops):
    loss and gradients equal the eager model's on two packs of different lengths, with and
    without activation checkpointing, and the dense families' blocks compile without graph
    breaks. (On CPU the same blocks compile whole on the torch path too, but take minutes: the
    ops' compiled test is in lmms-kernels.)"""
    pytest.importorskip("fla")
    _compiled_matches_eager(name, "cuda", "fla", "inductor", ac)


@pytest.mark.gpu
@pytest.mark.parametrize("name", LINEAR_FAMILIES)
def test_gpu_fla_kernels_match_torch_reference(name):
    """On CUDA the packed mixers on flash-linear-attention's varlen kernels equal the plain-torch
    reference path (fp32 weights, loss and gradients)."""
    pytest.importorskip("fla")
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa").cuda()
    batch = pack_samples(spec, model, _samples(spec, model))
    out = {}
    for backend in ("torch", "fla"):
        spec.set_linear_backend(model, backend)
        model.zero_grad(set_to_none=True)
        loss, _ = spec.packed_forward(
            model, {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
        )
        loss.backward()
        out[backend] = (loss.detach(), full_grads(model))
    torch.testing.assert_close(out["fla"][0], out["torch"][0], rtol=2e-3, atol=2e-3)
    for k, g in out["torch"][1].items():
        scale = g.abs().max().clamp_min(1e-3)
        err = float((out["fla"][1][k] - g).abs().max() / scale)
        assert err < 1e-2, (k, err)


@pytest.mark.gpu
def test_gpu_fla_mixer_matches_fla_layer():
    """lmms' packed mixer == flash-linear-attention's own GatedDeltaNet layer, unpacked per sample
    and with its own cu_seqlens (fp32)."""
    pytest.importorskip("fla")
    torch.manual_seed(0)
    spec = get_model_spec("fla_gated_deltanet")
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa").cuda()
    layer = spec.linear_mixers(model)[0]
    lens = [300, 1, 65, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    x = torch.randn(1, sum(lens), 64, device="cuda")
    spec.set_linear_backend(model, "fla")
    with torch.no_grad():
        ours = layer(x, cu_seq_lens_q=cu)[0]
        theirs_varlen = type(layer).forward(layer, x, cu_seqlens=cu.long())[0]
        alone = torch.cat(
            [
                type(layer).forward(layer, x[:, a:b])[0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
            ],
            1,
        )
    torch.testing.assert_close(ours, theirs_varlen, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(ours, alone, rtol=2e-3, atol=2e-3)
