"""Diffusion-transformer families (sit, wan): forwards against diffusers' own classes with the
same weights, the flow-matching objective through the spec, FLOPs against the built modules."""

from __future__ import annotations

import pytest
import torch
from _diffusion_cases import sit_pixel_batch

from lmms_models import _flow_matching as fm
from lmms_models import get_model_spec
from lmms_models.objectives import ObjectiveContext, get_objective

diffusers = pytest.importorskip("diffusers")


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """SiT zero-initialises its adaLN and output layers: parity on zeros proves nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _sit_into_diffusers_dit(model) -> torch.nn.Module:
    """diffusers' DiTTransformer2DModel holding SiT's weights: the shared embedders copied into
    every block, qkv split, its timestep features' frequency offset set to SiT's (0)."""
    c = model.config
    dit = diffusers.DiTTransformer2DModel(
        num_attention_heads=c.num_heads, attention_head_dim=c.hidden_size // c.num_heads,
        in_channels=c.in_channels, out_channels=c.out_channels, num_layers=c.depth,
        sample_size=c.input_size, patch_size=c.patch_size, num_embeds_ada_norm=c.num_classes,
        norm_eps=1e-6,
    )  # fmt: skip
    sd = model.state_dict()
    out = {
        "pos_embed.proj.weight": sd["x_embedder.proj.weight"],
        "pos_embed.proj.bias": sd["x_embedder.proj.bias"],
        "proj_out_1.weight": sd["final_layer.adaLN_modulation.1.weight"],
        "proj_out_1.bias": sd["final_layer.adaLN_modulation.1.bias"],
        "proj_out_2.weight": sd["final_layer.linear.weight"],
        "proj_out_2.bias": sd["final_layer.linear.bias"],
    }
    for i in range(c.depth):
        d, s = f"transformer_blocks.{i}.", f"blocks.{i}."
        emb = d + "norm1.emb."
        for w in ("weight", "bias"):
            out[emb + f"timestep_embedder.linear_1.{w}"] = sd[f"t_embedder.mlp.0.{w}"]
            out[emb + f"timestep_embedder.linear_2.{w}"] = sd[f"t_embedder.mlp.2.{w}"]
            out[d + f"norm1.linear.{w}"] = sd[s + f"adaLN_modulation.1.{w}"]
            q, k, v = sd[s + f"attn.qkv.{w}"].chunk(3, dim=0)
            out[d + f"attn1.to_q.{w}"], out[d + f"attn1.to_k.{w}"] = q, k
            out[d + f"attn1.to_v.{w}"] = v
            out[d + f"attn1.to_out.0.{w}"] = sd[s + f"attn.proj.{w}"]
            out[d + f"ff.net.0.proj.{w}"] = sd[s + f"mlp.fc1.{w}"]
            out[d + f"ff.net.2.{w}"] = sd[s + f"mlp.fc2.{w}"]
        out[emb + "class_embedder.embedding_table.weight"] = sd["y_embedder.embedding_table.weight"]
        dit.transformer_blocks[i].norm1.emb.time_proj.downscale_freq_shift = 0
    missing, unexpected = dit.load_state_dict(out, strict=False)
    assert not unexpected and set(missing) <= {"pos_embed.pos_embed"}, (missing, unexpected)
    return dit.eval()


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_sit_forward_equals_diffusers_dit(learn_sigma: bool) -> None:
    spec = get_model_spec("sit")
    model = spec.build(config=spec.tiny_config(learn_sigma=learn_sigma, input_size=8)).eval()
    _randomize(model)
    dit = _sit_into_diffusers_dit(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 8, 8, generator=g)
    t = torch.tensor([0.1, 0.5, 0.97])
    y = torch.tensor([0, 3, 4])  # 4: the null class
    with torch.no_grad():
        ours = model(x, t, y)
        theirs = dit(x, timestep=t, class_labels=y).sample
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.abs().mean() > 0.05


def test_sit_objective_through_spec_and_gradients() -> None:
    spec = get_model_spec("sit")
    model = spec.build(config=spec.tiny_config())
    _randomize(model, seed=3)
    obj = get_objective("flow_matching", cfg_dropout=0.5, time_sampling="logit_normal")
    batch = sit_pixel_batch()
    out = obj.loss(spec, model, batch, ObjectiveContext(seed=5))
    # the same computation by hand, from the documented draws
    from lmms_models.objectives.flow_matching import sample_seeds

    cfg = obj.options
    d = fm.draw(cfg, sample_seeds(5, batch["noise_seed"]), (3, 8, 8), "cpu")
    x1 = batch["pixel_values"]
    xt = fm.interpolant("linear", d.t, x1, d.noise)[0]
    y = torch.where(d.drop, torch.full_like(batch["class_labels"], 4), batch["class_labels"])
    ref = ((model(xt, d.t, y) - (x1 - d.noise)) ** 2).mean(dim=(1, 2, 3)).sum()
    torch.testing.assert_close(out.loss_sum, ref)
    assert int(out.count) == 4 and obj.count_tokens(batch) == 4
    assert sum(float(v[1]) for v in out.metrics.values()) == 4
    out.loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters())
    # a second call with the same seeds draws the same noise: the same loss, bit for bit
    again = obj.loss(spec, model, batch, ObjectiveContext(seed=5, step=9))
    assert torch.equal(again.loss_sum.detach(), out.loss_sum.detach())


def test_sit_vae_on_the_fly_and_presets() -> None:
    from lmms_models import attach_encoder

    spec = get_model_spec("sit")
    model = spec.build(config=spec.tiny_config(in_channels=4, input_size=4))
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
        layers_per_block=1,
    )  # fmt: skip
    attach_encoder(model, "vae", vae)
    assert not any(n.startswith("vae") for n in model.state_dict())
    pixels = torch.rand(2, 3, 8, 8) * 2 - 1
    x1, y = spec.diffusion_inputs(model, {"pixel_values": pixels, "class_labels": torch.ones(2)})
    assert x1.shape == (2, 4, 4, 4) and y.dtype == torch.int64
    with torch.no_grad():
        want = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
    torch.testing.assert_close(x1, want)
    # presets: SiT paper sizes; parameter counts of the built (meta) models
    xl = spec.build(config=spec.preset("XL/2"), device="meta")
    n = sum(p.numel() for p in xl.parameters())
    assert 670e6 < n < 680e6  # SiT-XL/2 (learn_sigma): 675M
    assert set(spec.presets) == {f"{s}/{p}" for s in ("S", "B", "L", "XL") for p in (2, 4, 8)}


def test_sit_flops_count_the_built_module() -> None:
    spec = get_model_spec("sit")
    conf = spec.make_config(spec.preset("B/4"))
    model = spec.build(config=spec.preset("B/4"), device="meta")
    per_token = sum(p.numel() for n, p in model.named_parameters() if "adaLN" not in n
                    and not n.startswith(("t_embedder", "y_embedder")))  # fmt: skip
    assert spec.matmul_params(conf) == per_token
    assert spec.tokens_per_sample(conf, (4, 32, 32)) == 64
    flops = spec.lm_flops(conf, [64, 64])
    assert flops > 6 * per_token * 128


# ---------------------------------------------------------------------------- wan
def _wan_encoders():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(5)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[True], latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.5, 2.0, 1.0],
    )  # fmt: skip
    text = UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                       num_heads=2, relative_attention_num_buckets=8))  # fmt: skip
    return vae, text


def test_wan_objective_is_wans_rectified_flow() -> None:
    """x_t = (1 - s) x + s noise, timestep 1000 s with s shifted, target noise - x, through
    diffusers' own WanTransformer3DModel forward; text and video encoded on the fly."""
    from lmms_models import attach_encoder
    from lmms_models.families.wan import encode_text, encode_video, vae_factors
    from lmms_models.objectives.flow_matching import sample_seeds

    spec = get_model_spec("wan")
    model = spec.build(config=spec.tiny_config())
    vae, text = _wan_encoders()
    attach_encoder(model, "vae", vae)
    attach_encoder(model, "text_encoder", text)
    assert vae_factors(vae) == (2, 2)
    g = torch.Generator().manual_seed(0)
    batch = {
        "pixel_values": torch.rand(2, 3, 5, 8, 12, generator=g) * 2 - 1,
        "input_ids": torch.tensor([[5, 6, 7, 1, 0, 0], [9, 1, 0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]),
        "noise_seed": torch.tensor([3, 4]),
        "num_loss_tokens": 2,
    }
    obj = get_objective("flow_matching", convention="rectified_flow", shift=5.0,
                        time_sampling="logit_normal")  # fmt: skip
    out = obj.loss(spec, model, batch, ObjectiveContext(seed=1))
    with torch.no_grad():
        z = vae.encode(batch["pixel_values"]).latent_dist.mean
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.5, 2.0, 1.0]).view(1, 4, 1, 1, 1)
    x = (z - mean) / std
    torch.testing.assert_close(encode_video(vae, batch["pixel_values"]), x)
    states = encode_text(text, batch["input_ids"], batch["attention_mask"])
    assert torch.all(states[1, 2:] == 0) and torch.all(states[0, :4] != 0)
    d = fm.draw(obj.options, sample_seeds(1, batch["noise_seed"]), tuple(x.shape[1:]), "cpu")
    s = 1 - d.t  # noise level (already shifted)
    xt = (1 - s)[:, None, None, None, None] * x + s[:, None, None, None, None] * d.noise
    pred = model(hidden_states=xt, timestep=1000 * s, encoder_hidden_states=states).sample
    ref = ((pred - (d.noise - x)) ** 2).mean(dim=(1, 2, 3, 4)).sum()
    torch.testing.assert_close(out.loss_sum, ref)
    assert spec.tokens_per_sample(model.config, x.shape[1:]) == 3 * 2 * 3


def test_wan_presets_and_flops() -> None:
    spec = get_model_spec("wan")
    sizes = {"1.3b": 1.419e9, "14b": 14.288e9, "2.2-5b": 5.000e9}  # Wan2.1 / Wan2.2 checkpoints
    for name, want in sizes.items():
        model = spec.build(config=spec.preset(name), device="meta")
        n = sum(p.numel() for p in model.parameters())
        assert abs(n - want) / want < 1e-3, (name, n)
        per_token = sum(
            p.numel() for k, p in model.named_parameters()
            if not k.startswith(("condition_embedder", "scale_shift_table"))
            and ".scale_shift_table" not in k and "attn2.to_k" not in k and "attn2.to_v" not in k
            and "norm_added" not in k
        )  # fmt: skip
        assert spec.matmul_params(model.config) == per_token, name
    conf = spec.make_config(spec.preset("1.3b"))
    tokens = spec.tokens_per_sample(conf, (16, 21, 60, 104))  # 480p x 81 frames
    assert tokens == 21 * 30 * 52
    assert spec.lm_flops(conf, [tokens]) > 6 * spec.matmul_params(conf) * tokens
