import math

import pytest
import torch
from _kernels_ref import dense_reference, random_cu_seqlens

import lmms_kernels as lk

# head dims of the supported families: 64/128 (Qwen2/2.5/3 text), 80 (Qwen2.5-VL vision), 72 (Qwen3-VL vision)
CASES = [(2, 2, 64), (4, 2, 128), (6, 1, 80), (4, 4, 72)]


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_and_flex_match_dense_reference(causal):
    gen = torch.Generator().manual_seed(0)
    for h, kv, d in CASES:
        for total in (1, 7, 53):
            cu = random_cu_seqlens(total, 6, gen)
            q = torch.randn(total, h, d, generator=gen)
            k, v = (
                torch.randn(total, kv, d, generator=gen),
                torch.randn(total, kv, d, generator=gen),
            )
            mx = int(torch.diff(cu).max())
            ref = dense_reference(q, k, v, cu, cu, causal=causal)
            for backend in ("sdpa", "flex"):
                out = lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend=backend)
                assert out.shape == (total, h, d)
                torch.testing.assert_close(
                    out, ref, atol=2e-5, rtol=1e-4, msg=f"{backend} {h=} {kv=} {d=} {cu=}"
                )


def test_no_attention_across_segments():
    # changing tokens of segment 1 must not change outputs of segment 0 (both directions)
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, 16, generator=gen) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[5:] += 3.0
    v2[5:] -= 2.0
    for causal in (True, False):
        a = lk.varlen_attention(q, k, v, cu, cu, 7, 7, causal=causal, backend="sdpa")
        b = lk.varlen_attention(q, k2, v2, cu, cu, 7, 7, causal=causal, backend="sdpa")
        torch.testing.assert_close(a[:5], b[:5])
        assert not torch.allclose(a[5:], b[5:])


def test_cross_lengths_softmax_scale_and_grads():
    gen = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor(
        [0, 5, 7, 13], dtype=torch.int32
    )  # more keys than queries: bottom-right causal
    q = torch.randn(9, 4, 32, generator=gen, requires_grad=True)
    k = torch.randn(13, 2, 32, generator=gen, requires_grad=True)
    v = torch.randn(13, 2, 32, generator=gen, requires_grad=True)
    for causal in (True, False):
        out = lk.varlen_attention(
            q, k, v, cu_q, cu_k, 5, 6, causal=causal, softmax_scale=0.3, backend="sdpa"
        )
        ref = dense_reference(q, k, v, cu_q, cu_k, causal=causal, scale=0.3)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        g = torch.randn_like(out)
        ga = torch.autograd.grad(out, (q, k, v), g)
        gb = torch.autograd.grad(ref, (q, k, v), g)
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    q, k, v = q.detach(), k.detach(), v.detach()  # FlexAttention has no CPU backward
    for causal in (True, False):
        out = lk.varlen_attention(q, k, v, cu_q, cu_k, 5, 6, causal=causal, backend="flex")
        ref = dense_reference(q, k, v, cu_q, cu_k, causal=causal)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_bf16_sdpa_close_to_fp32():
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, 4, 64, generator=gen) for _ in range(3))
    ref = lk.varlen_attention(q, k, v, cu, cu, 23, 23, causal=True, backend="sdpa")
    out = lk.varlen_attention(
        *(x.bfloat16() for x in (q, k, v)), cu, cu, 23, 23, causal=True, backend="sdpa"
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_backend_choice_and_errors():
    assert lk.available_backends("cpu")[-1] == "sdpa"
    assert lk.resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        lk.resolve_backend("nope", "cpu")
    for name in ("fa4", "fa", "torch"):
        with pytest.raises(RuntimeError, match="not available"):
            lk.resolve_backend(name, "cpu")
    q = torch.randn(4, 3, 8)
    with pytest.raises(ValueError, match="multiple"):
        lk.varlen_attention(
            q, q[:, :2], q[:, :2], torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, causal=True
        )
    with pytest.raises(ValueError, match="dtypes"):
        lk.varlen_attention(
            q, q.double(), q, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, causal=True
        )
    assert math.isclose(
        float(
            lk.varlen_attention(
                q, q, q, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, causal=True
            )
            .abs()
            .sum()
            > 0
        ),
        1.0,
    )


def test_auto_takes_sdpa_for_fp32_where_the_fastest_backend_is_a_flash_kernel(monkeypatch):
    """An fp32 run on CUDA (``bf16: false``): "auto" must not pick a flash kernel (they raise
    "FlashAttention only support fp16 and bf16 data type"); 16-bit inputs keep the fastest."""
    from lmms_kernels import _attention

    monkeypatch.setattr(_attention, "available_backends", lambda device: ["torch", "flex", "sdpa"])
    monkeypatch.setattr(_attention, "_AUTO", {})
    assert lk.resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    assert lk.resolve_backend("auto", "cuda", torch.bfloat16) == "torch"
    assert lk.resolve_backend("auto", "cuda") == "torch"
    monkeypatch.setattr(_attention, "available_backends", lambda device: ["flex", "sdpa"])
    assert lk.resolve_backend("auto", "cuda", torch.float32) == "flex"
