"""The aligned SwiGLU (intermediate width zero-padded to a multiple of 8 for cuBLAS' Hopper
GEMMs) equals the upstream MLP exactly in value and gradient, with and without biases."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmms_kernels._liger import _aligned_swiglu, _torch_silu_mul


class _MLP(nn.Module):  # the upstream SwiGLU MLP shape (Qwen2MLP / Qwen2_5_VLMLP)
    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("inter", [3420 // 20, 37])  # 171 and 37: not multiples of 8
def test_aligned_swiglu_equals_upstream(bias, inter):
    torch.manual_seed(0)
    mlp = _MLP(24, inter, bias).double()
    pad = -inter % 8
    assert pad
    x = torch.randn(13, 24, dtype=torch.float64, requires_grad=True)
    ref = mlp(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *mlp.parameters()])
    out = _aligned_swiglu(mlp, x, pad, _torch_silu_mul)
    grads = torch.autograd.grad(out.square().sum(), [x, *mlp.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.shape == r.shape  # padding never reaches the parameters' gradients
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_liger_patched_unaligned_mlp_matches_upstream_on_cuda():
    """On CUDA the Liger patch takes the aligned path for a 3420-wide MLP (Liger's silu·mul on
    the padded activations); bf16 outputs and grads agree with the unpatched module."""
    from lmms_kernels._liger import _patch_mlp

    torch.manual_seed(0)
    mlp = _MLP(256, 3420, bias=True).cuda().bfloat16()
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = mlp(x)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), [x, *mlp.parameters()])
    patched = _patch_mlp(mlp, mlp.forward)
    out = patched(x)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *mlp.parameters()])
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g.float() - r.float()).norm() / r.float().norm() < 2e-2
