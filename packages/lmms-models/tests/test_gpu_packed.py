"""GPU: the packed forward with the real kernels (bf16 autocast) against the upstream unpacked
forward, for every family, and every available lmms varlen backend."""

from __future__ import annotations

import pytest
import torch

from lmms_models import get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples, reference_loss_sum

pytestmark = pytest.mark.gpu


def _backends():
    import lmms_kernels

    return [b for b in lmms_kernels.available_backends() if b in ("fa4", "fa", "torch", "flex")]


@pytest.mark.parametrize(
    "name", ["qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llama"]
)
def test_packed_matches_unpacked_on_gpu(name):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    # head_dim 64 so that every flash backend accepts it
    over = {"num_attention_heads": 2} if spec.position_rows == 1 else {}
    if name in ("qwen3", "qwen3_moe"):
        over["head_dim"] = 64
    cfg = spec.tiny_config(**over) if over else spec.tiny_config()
    if name == "qwen2_5_vl":
        cfg["text_config"].update(
            num_attention_heads=1,
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [16, 8, 8],
            },
        )
    model = spec.build(config=cfg, device="cuda", attn_backend="sdpa")
    gen = torch.Generator().manual_seed(0)
    specs = [SampleSpec(text=40), SampleSpec(text=1, prompt=0), SampleSpec(text=17)]
    if spec.position_rows > 1:
        specs += [
            SampleSpec(text=9, images=[(1, 4, 4), (1, 2, 6)]),
            SampleSpec(text=5, videos=[(2, 4, 4)]),
        ]
    samples = [make_sample(spec, model.config, s, gen=gen) for s in specs]
    samples = [{k: v.cuda() for k, v in s.items()} for s in samples]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref, n = reference_loss_sum(spec, model, samples)
    batch = pack_samples(spec, model, samples, pad_to=256)
    for backend in _backends():
        spec.set_attention(model, backend=backend)
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            loss, count = spec.packed_forward(model, batch)
        assert int(count) == n
        torch.testing.assert_close(
            loss.float().cpu(), ref.detach().float().cpu(), rtol=2e-2, atol=1e-2, msg=backend
        )
        spec.set_attention(model, backend="sdpa")


def test_qwen2_5_vl_tower_runs_without_host_sync_from_host_grids():
    """Host grids under `media_context`: the vision tower (blocks, merger) runs under CUDA's sync
    debug mode "error" without a synchronising call; from device grids upstream synchronises."""
    spec = get_model_spec("qwen2_5_vl")
    if not spec.host_keys:
        pytest.skip("this transformers does not accept precomputed vision inputs")
    backends = [b for b in _backends() if b != "flex"]
    if not backends:
        pytest.skip("no sync-free varlen backend (fa4, fa or torch) available")
    torch.manual_seed(0)
    model = spec.build(  # bf16: FA4 takes 16-bit inputs only
        config=spec.tiny_config(), device="cuda", dtype=torch.bfloat16, attn_backend=backends[0]
    )
    gen = torch.Generator().manual_seed(0)
    specs = [
        SampleSpec(text=9, images=[(1, 4, 4), (1, 2, 6)]),
        SampleSpec(text=5, images=[(1, 6, 4)]),
    ]
    samples = [make_sample(spec, model.config, s, gen=gen) for s in specs]
    batch = pack_samples(spec, model, samples)  # on the host, as the trainer leaves the grids
    media = spec.media_inputs(batch, torch.device("cuda"))
    pixels = media["pixel_values"].to(torch.bfloat16)
    host_kwargs = {"pixel_values": pixels, "image_grid_thw": media["image_grid_thw"]}
    assert host_kwargs["image_grid_thw"].device.type == "cpu"
    base = spec.base_model(model)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad(), spec.media_context(model):
            host = base.get_image_features(**host_kwargs).pooler_output
    finally:
        torch.cuda.set_sync_debug_mode("default")
    device_kwargs = {**host_kwargs, "image_grid_thw": host_kwargs["image_grid_thw"].cuda()}
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError), torch.no_grad():
            base.get_image_features(**device_kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.no_grad():
        ref = base.get_image_features(**device_kwargs).pooler_output
    for a, b in zip(host, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_linear_patch_embed_matches_cudnn_on_gpu(name):
    """bf16 on CUDA: the GEMM against cuDNN's Conv3d, forward and weight gradient, at a patch
    count of a real pack (both accumulate in fp32; they differ by bf16 rounding of the output)."""
    from lmms_models import linear_patch_embed

    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), device="cuda", dtype=torch.bfloat16)
    embed = spec.vision_tower(model).patch_embed
    x = torch.randn(20_608, embed.proj.weight[0].numel(), device="cuda")
    grads = []
    for linear in (False, True):
        handle = linear_patch_embed(spec.vision_tower(model)) if linear else None
        out = embed(x)
        (g,) = torch.autograd.grad(out.float().square().sum(), embed.proj.weight)
        grads.append((out.float(), g.float()))
        if handle is not None:
            handle.remove()
    (ref, g_ref), (got, g) = grads
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g, g_ref, rtol=3e-2, atol=3e-2 * g_ref.abs().max().item())
