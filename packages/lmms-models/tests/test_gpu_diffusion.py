"""Diffusion families on the GPU (bf16 autocast): the flow-matching objective through the spec
equals the same loss computed by hand from diffusers' own forward at the real Wan2.1-1.3B layer
width on a 480p-like token grid, and SiT-B/2 trains a step with finite gradients."""

from __future__ import annotations

import pytest
import torch

from lmms_models import _flow_matching as fm
from lmms_models import get_model_spec
from lmms_models.objectives import ObjectiveContext, get_objective
from lmms_models.objectives.flow_matching import sample_seeds

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_wan_1p3b_width_objective_equals_hand_loss_bf16() -> None:
    spec = get_model_spec("wan")
    conf = {**spec.preset("1.3b"), "num_layers": 2}
    torch.manual_seed(0)
    model = spec.build(config=conf, device="cuda")
    g = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(1, 16, 5, 30, 52, generator=g).cuda(),
             "text_embeds": torch.randn(1, 512, 4096, generator=g).cuda(),
             "noise_seed": torch.tensor([7]), "num_loss_tokens": 1}  # fmt: skip
    obj = get_objective("flow_matching", **spec.objective_defaults)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = obj.loss(spec, model, batch, ObjectiveContext(seed=3))
        d = fm.draw(obj.options, sample_seeds(3, batch["noise_seed"]), (16, 5, 30, 52), "cuda")
        s = (1 - d.t).view(-1, 1, 1, 1, 1)
        x = batch["latents"]
        xt = (1 - s) * x + s * d.noise
        pred = model(xt, 1000 * s.flatten(), batch["text_embeds"], return_dict=False)[0]
    ref = ((pred.float() - (d.noise - x)) ** 2).mean()
    torch.testing.assert_close(out.loss_sum.float(), ref, rtol=1e-3, atol=1e-4)
    out.loss_sum.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_sit_b2_step_bf16() -> None:
    spec = get_model_spec("sit")
    model = spec.build(config=spec.preset("B/2"), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    obj = get_objective("flow_matching", cfg_dropout=0.1)
    batch = {"latents": torch.randn(8, 4, 32, 32, device="cuda"),
             "class_labels": torch.arange(8, device="cuda"), "noise_seed": torch.arange(8),
             "num_loss_tokens": 8}  # fmt: skip
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = obj.loss(spec, model, batch, ObjectiveContext(seed=0)).loss_sum / 8
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_wan_text_encoder_offload_streams_blocks_and_equals_replicate() -> None:
    """``frozen_encoders: offload`` on CUDA: umT5's blocks live on the CPU between forwards and
    its states equal the replicated (on-GPU) encoder's."""
    from lmms_models import get_encoder, place_encoders

    spec = get_model_spec("wan")
    conf = spec.tiny_config(text_encoder=dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128,
                            num_layers=3, num_heads=4, relative_attention_num_buckets=8))  # fmt: skip
    ids = torch.randint(2, 256, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "latents": torch.zeros(2, 4, 1, 2, 2)}  # fmt: skip
    states = {}
    for mode in ("replicate", "offload"):
        model = spec.build(config=conf)
        place_encoders(model, mode, blocks=spec.encoder_blocks, device="cuda")
        enc = get_encoder(model, "text_encoder", torch.device("cuda"))
        states[mode] = spec.encode_batch({"text_encoder": enc}, batch, "cuda")[1]
        where = {p.device.type for p in enc.encoder.block.parameters()}
        assert where == ({"cpu"} if mode == "offload" else {"cuda"}), (mode, where)
        assert enc.shared.weight.device.type == "cuda"
    assert states["offload"].device.type == "cuda"
    torch.testing.assert_close(states["offload"], states["replicate"], rtol=1e-5, atol=1e-5)
