"""`lmms_kernels.warm_attention`: every attention signature called (eagerly or as the compiled
custom op) is recorded once, and replayed forward and backward at the given segment counts."""

import pytest
import torch

import lmms_kernels as lk
from lmms_kernels import _attention as A


def test_calls_are_recorded_and_replayed(monkeypatch):
    monkeypatch.setattr(A, "CALLS", {})
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(10, 4, 8, generator=gen, requires_grad=True)
    k, v = torch.randn(10, 2, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for _ in range(2):  # the same signature twice: one record
        lk.varlen_attention(q, k, v, cu, cu, 6, 6, causal=True, backend="sdpa")
    out, _ = torch.ops.lmms_kernels.varlen_attn(q, k, v, cu, cu, 6, 6, False, 0.5, "sdpa")
    out.sum().backward()
    calls = lk.attention_calls()
    cpu = torch.device("cpu")
    assert calls == [
        ("eager", "sdpa", 4, 2, 8, 8, torch.float32, True, None, cpu),
        ("op", "sdpa", 4, 2, 8, 8, torch.float32, False, 0.5, cpu),
    ]
    assert lk.warm_attention((1, 3), seg_len=4) == 0  # only FA4's by default: none here
    seen = []
    real = A._IMPLS["sdpa"]

    def spy(q, k, v, cu_q, cu_k, *rest):
        seen.append((q.shape[0], cu_q.numel() - 1, q.requires_grad))
        return real(q, k, v, cu_q, cu_k, *rest)

    monkeypatch.setitem(A._IMPLS, "sdpa", spy)
    assert lk.warm_attention((1, 3), seg_len=4, backends=None) == 4
    # each replay: n segments of 4 tokens; the op's backward re-runs the forward under autograd
    assert [s[:2] for s in seen] == [(4, 1), (12, 3), (4, 1), (4, 1), (12, 3), (12, 3)]
    assert lk.attention_calls() == calls  # replays add no new signatures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_variants_compile_in_the_warm_up_not_later(monkeypatch):
    """On the GPU with FA4: after a compiled-op call of a ViT-like signature and the warm-up, a
    call with more than 256 segments (FA4's varlen batch switch) compiles no new FA4 kernel."""
    if "fa4" not in lk.available_backends("cuda"):
        pytest.skip("FA4 not installed")
    monkeypatch.setattr(A, "CALLS", {})
    q, k, v = (torch.randn(64 * 8, 16, 80, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    cu = torch.arange(0, 64 * 8 + 1, 64, dtype=torch.int32, device="cuda")  # 8 windows
    out, _ = torch.ops.lmms_kernels.varlen_attn(q, k, v, cu, cu, 64, 64, False, None, "fa4")
    out.sum().backward()
    assert lk.warm_attention() == 3  # counts 1, 255, 257
    held = lk.fa4_variants()
    n = 300  # over 256 sequences of the warm-up's length, another total
    q2, k2, v2 = (torch.randn(n * 64, 16, 80, device="cuda", dtype=torch.bfloat16,
                              requires_grad=True) for _ in range(3))  # fmt: skip
    cu2 = torch.arange(0, n * 64 + 1, 64, dtype=torch.int32, device="cuda")
    out, _ = torch.ops.lmms_kernels.varlen_attn(q2, k2, v2, cu2, cu2, 64, 64, False, None, "fa4")
    out.sum().backward()
    torch.cuda.synchronize()
    assert lk.fa4_variants() == held, lk.describe_new_fa4_kernels({}, lk.fa4_kernel_keys())
