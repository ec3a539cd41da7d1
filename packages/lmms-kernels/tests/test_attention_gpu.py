"""CUDA parity of every available backend against the SDPA-per-segment reference (fwd + bwd)."""

import functools

import pytest
import torch
from _kernels_ref import cuda_attention_cases, fwd_bwd

import lmms_kernels as lk

pytestmark = pytest.mark.gpu

FAST = ["fa4", "fa", "torch", "flex"]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("head_dim", [64, 128, 80, 72])
@pytest.mark.parametrize("causal", [True, False])
def test_backend_matches_sdpa_reference(backend, head_dim, causal):
    for h, kv, cu, mx, q, k, v, g in cuda_attention_cases(backend, head_dim, causal):

        def attend(q, k, v, backend, cu=cu, mx=mx):
            return lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend=backend)

        ref = fwd_bwd(
            functools.partial(attend, backend="sdpa"), q.float(), k.float(), v.float(), g.float()
        )
        got = fwd_bwd(functools.partial(attend, backend=backend), q, k, v, g)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(
                a.float(), b, atol=2e-2, rtol=2e-2, msg=f"{backend} {name} {h=} {kv=}"
            )


def test_auto_prefers_fastest_on_cuda():
    avail = lk.available_backends("cuda")
    assert lk.resolve_backend("auto", "cuda") == avail[0]
    assert avail[0] in FAST


def test_fa4_variants_counts_the_kernels_fa4_holds():
    if "fa4" not in lk.available_backends("cuda"):
        pytest.skip("fa4 not installed")
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = lk.varlen_attention(q, q, q, cu, cu, 200, 200, causal=True, backend="fa4")
    out.sum().backward()
    assert lk.fa4_variants() >= 2  # at least one forward and one backward kernel
