"""`lmms_kernels.warm_attention`: every attention signature called (eagerly or as the compiled
custom op) is recorded once, and replayed forward and backward at the given segment counts."""

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
