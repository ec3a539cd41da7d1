"""Grouped-GEMM experts == the plain-torch loop == transformers' eager experts (values, grads).

Odd token counts, experts that receive no token, k = 1 and k = 2, fp32 (exact up to summation
order) and bf16 (bf16 tolerance). The upstream experts module is a tiny Qwen3-MoE block's.
"""

from __future__ import annotations

import pytest
import torch

from lmms_kernels import (
    expert_counts,
    experts_forward,
    grouped_experts,
    grouped_mm_available,
    register_experts,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _weights(n_exp, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(n_exp, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(n_exp, hidden, inter, generator=g) * 0.2).to(dtype)
    return gate_up.requires_grad_(), down.requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [1, 1, 1, 1]])
def test_grouped_matches_loop(dtype, counts):
    hidden, inter = 16, 8
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = {}
    for backend in ("grouped_mm", "loop"):
        gate_up, down = _weights(len(counts), hidden, inter, dtype)
        xb = x.clone().requires_grad_()
        y = grouped_experts(xb, torch.tensor(counts), gate_up, down, backend=backend)
        (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        out[backend] = (y.detach(), xb.grad, gate_up.grad, down.grad)
    rtol, atol = TOL[dtype]
    for got, ref in zip(out["grouped_mm"], out["loop"], strict=True):
        torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)
    # the experts without rows get zero gradient, the others do not
    for e, c in enumerate(counts):
        assert bool(out["grouped_mm"][2][e].abs().sum() > 0) == (c > 0)


def test_alignment_rule_and_unknown_backend():
    x = torch.randn(4, 6)  # 24-byte rows: not a multiple of 16
    gate_up, down = _weights(2, 6, 4, torch.float32)
    assert not grouped_mm_available(x, gate_up, down)
    assert grouped_mm_available(torch.randn(4, 8), *_weights(2, 8, 4, torch.float32))
    with pytest.raises(ValueError, match="unknown experts backend"):
        grouped_experts(x, torch.tensor([2, 2]), gate_up, down, backend="fast")
    y = grouped_experts(x, torch.tensor([2, 2]), gate_up, down)  # auto falls back to the loop
    ref = grouped_experts(x, torch.tensor([2, 2]), gate_up, down, backend="loop")
    assert torch.equal(y, ref)


def test_expert_counts():
    ids = torch.tensor([2, 0, 2, 3, 2])
    assert expert_counts(ids, 5).tolist() == [1, 0, 3, 1, 0]


def _upstream_block(seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return cfg, block


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_registered_forward_equals_upstream_eager(backend):
    cfg, block = _upstream_block()
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(3))
    grads = {}
    outs = {}
    for impl in ("eager", register_experts(f"lmms_test_{backend}", backend=backend)):
        cfg._experts_implementation = impl
        block.zero_grad(set_to_none=True)
        xb = x.clone().requires_grad_()
        y = block(xb)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        outs[impl] = y.detach()
        grads[impl] = {n: p.grad.clone() for n, p in block.named_parameters()} | {"x": xb.grad}
    ref, got = outs.pop("eager"), next(iter(outs.values()))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    g_ref, g_got = grads.pop("eager"), next(iter(grads.values()))
    for name in g_ref:
        torch.testing.assert_close(g_got[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # experts_forward called directly gives the same as through the registry
    with torch.no_grad():
        flat = x.reshape(-1, 32)
        _, w, idx = block.gate(flat)
        direct = experts_forward(block.experts, flat, idx, w, backend=backend)
    torch.testing.assert_close(direct.reshape(x.shape), ref, rtol=1e-5, atol=1e-6)
