"""Triton kernel and NS parity on CUDA at real and odd shapes (bf16 and fp32)."""

import pytest
import torch
from optim_reference import assert_ns_close, rel
from optim_triton_checks import check_kernels

import lmms_optim as lo

pytestmark = pytest.mark.gpu


def test_kernels_odd_and_real_shapes():
    shapes = [
        (3, 5, 40),
        (2, 37, 53),
        (1, 129, 257),
        (4, 200, 1000),
        (1, 896, 4864),
        (2, 1000, 1000),
    ]
    # fp16, not fp32: tl.dot on fp32 tiles uses TF32 on GPUs (NS only ever runs bf16)
    done = check_kernels("cuda", shapes, dtypes=(torch.bfloat16, torch.float16))
    assert len(done) == 3 * len(shapes)


@pytest.mark.parametrize("shape", [(896, 896), (4864, 896), (2048, 11008), (3, 512, 1536)])
@pytest.mark.parametrize("schedule", ["jordan", "polar_express"])
def test_newton_schulz_triton_vs_reference(shape, schedule):
    G = torch.randn(*shape, device="cuda")
    sch = lo.COEFFICIENT_SCHEDULES[schedule]
    out = lo.newton_schulz(G, coefficients=schedule)  # auto -> triton on CUDA
    ref = lo.newton_schulz_reference(G, coefficients=schedule)
    assert rel(out, ref) < 0.06
    if G.numel() <= 3 * 512 * 1536:  # the float64 check is costly at the big shapes
        assert_ns_close(out.cpu(), G.cpu(), 5, list(sch.coefficients), sch.norm_scale)


def test_muon_step_triton_matches_torch_backend_and_adamw_matches_fused():
    torch.manual_seed(0)
    shapes = [(256, 256)] * 3 + [(512, 256), (256, 1024), (7,), (33, 64, 1)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    mats = [p for p in ps if p.ndim == 2]
    mats_t = [p for p in twins if p.ndim == 2]
    other, other_t = [p for p in ps if p.ndim != 2], [p for p in twins if p.ndim != 2]
    a = lo.Muon(
        ps, lr=0.02, adjust_lr="rms", weight_decay=0.1, adamw_weight_decay=0.1, backend="triton"
    )
    b = lo.Muon(mats_t, lr=0.02, adjust_lr="rms", weight_decay=0.1, backend="torch")
    c = torch.optim.AdamW(other_t, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    for _ in range(3):
        for p, q in zip(ps, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        before = [p.detach().clone() for p in mats]
        a.step(), b.step(), c.step()
        for p, q, p0 in zip(mats, mats_t, before):
            assert rel(p.detach() - p0, q.detach() - p0) < 0.06
            q.data.copy_(p.data)
    for p, q in zip(other, other_t):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("shape", [(2048, 11008), (11008, 2048), (3, 256, 2048), (1280, 3420)])
def test_gram_method_cuda_vs_reference(shape, backend):
    """Gram-form NS on CUDA (bf16 cuBLAS, fp32 epilogues; with backend="triton" the symmetric
    products in the upper-triangle kernel): within bf16 tolerance of the published iteration at
    real shapes, wide and tall (no transpose), stacked."""
    G = torch.randn(*shape, device="cuda")
    out = lo.newton_schulz(G, method="gram", backend=backend)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    assert rel(out, lo.newton_schulz_reference(G)) < 0.06
    if G.numel() <= 3 * 256 * 2048:
        assert_ns_close(out.cpu(), G.cpu())


def test_muon_gram_matches_standard_on_cuda():
    torch.manual_seed(0)
    shapes = [(1024, 256), (1024, 256), (256, 1024), (64, 512)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a = lo.Muon(ps, lr=0.02, adjust_lr="rms", weight_decay=0.1, ns_method="gram")
    b = lo.Muon(twins, lr=0.02, adjust_lr="rms", weight_decay=0.1, ns_method="standard")
    for _ in range(3):
        for p, q in zip(ps, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        before = [p.detach().clone() for p in ps]
        a.step(), b.step()
        for p, q, p0 in zip(ps, twins, before):
            assert rel(p.detach() - p0, q.detach() - p0) < 0.06
            q.data.copy_(p.data)
