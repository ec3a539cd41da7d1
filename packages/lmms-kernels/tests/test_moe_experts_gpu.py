"""Grouped-GEMM experts on the GPU (bf16, 30B-A3B widths) == the plain-torch loop, values and
gradients; and no host synchronisation in the grouped path's forward and backward."""

from __future__ import annotations

import pytest
import torch

from lmms_kernels import grouped_experts, grouped_mm_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _case(counts, hidden=2048, inter=768, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_exp = len(counts)
    x = torch.randn(sum(counts), hidden, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(n_exp, 2 * inter, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(n_exp, hidden, inter, device="cuda", generator=g) * 0.02).bfloat16()
    return x, torch.tensor(counts, device="cuda"), gate_up, down


@pytest.mark.parametrize("counts", [[300, 0, 17, 1, 650, 0, 0, 64], [0] * 7 + [128]])
def test_grouped_matches_loop_bf16(counts):
    x, c, gate_up, down = _case(counts)
    assert grouped_mm_available(x, gate_up, down)
    out = {}
    for backend in ("grouped_mm", "loop"):
        xs = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        y = grouped_experts(xs[0], c, xs[1], xs[2], backend=backend)
        y.float().pow(2).sum().backward()
        out[backend] = [y.detach().float()] + [t.grad.float() for t in xs]
    for got, ref in zip(out["grouped_mm"], out["loop"], strict=True):
        scale = ref.abs().max().clamp_min(1e-6)
        assert float((got - ref).abs().max() / scale) < 2e-2


def test_grouped_path_does_not_synchronise():
    x, c, gate_up, down = _case([100, 0, 50, 6])
    xs = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_experts(xs[0], c, xs[1], xs[2], backend="grouped_mm")
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
