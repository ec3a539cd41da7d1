"""Varlen linear attention: the chunked torch reference against a token-by-token recurrence run
per segment, the varlen convolution against ``conv1d`` per segment, no state leak across segment
boundaries, and (GPU) flash-linear-attention's varlen kernels against the torch reference."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lmms_kernels import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    gated_rms_norm,
    resolve_linear_backend,
)

# a sample longer than a chunk ending mid-chunk, a length-1 sample, one of exactly a chunk
LENS = [70, 1, 13, 64, 3]


def _cu(lens, device="cpu"):
    return torch.tensor(
        [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )


def _inputs(lens, hk=2, hv=4, dk=8, dv=6, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.5  # log decay
    beta = torch.rand(t, hv, generator=gen)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, g, beta)]


def _recurrent(q, k, v, g, beta):
    """One segment, token by token: S = e^g S; S += k (β (v - Sᵀk))ᵀ; o = Sᵀ q / sqrt(Dk)."""
    rep = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    state = q.new_zeros(v.shape[1], q.shape[-1], v.shape[-1])  # [H, Dk, Dv]
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        err = v[t] - torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * err)
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]) * q.shape[-1] ** -0.5)
    return torch.stack(outs)


def _per_segment(fn, lens, *xs):
    cu = _cu(lens).tolist()
    return torch.cat([fn(*(x[a:b] for x in xs)) for a, b in itertools.pairwise(cu)])


def _grads(out, inputs, seed=3):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad((out * w).sum(), inputs)


def test_delta_rule_matches_recurrence_per_segment():
    # chunks of 16: ends mid-chunk (37, 13, 3), a length-1 sample, exactly one chunk (16)
    lens = [37, 1, 13, 16, 3]
    xs = _inputs(lens)
    out = gated_delta_rule_varlen(*xs, _cu(lens), chunk_size=16, backend="torch")  # [T, Hv, Dv]
    ref = _per_segment(_recurrent, lens, *xs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(_grads(out, xs), _grads(ref, xs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_delta_rule_chunk_size_does_not_change_the_result(chunk):
    xs = _inputs(LENS)
    base = gated_delta_rule_varlen(*xs, _cu(LENS), backend="torch")
    out = gated_delta_rule_varlen(*xs, _cu(LENS), chunk_size=chunk, backend="torch")
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-5)


def _conv_ref(x, w, b):
    k = w.shape[1]
    y = F.conv1d(x.T[None], w[:, None], b, padding=k - 1, groups=x.shape[1])[0, :, : x.shape[0]]
    return F.silu(y.T)


def test_conv_matches_conv1d_per_segment():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENS), 12, generator=gen, requires_grad=True)
    w = torch.randn(12, 4, generator=gen, requires_grad=True)
    b = torch.randn(12, generator=gen, requires_grad=True)
    out = causal_conv1d_varlen(x, w, b, _cu(LENS), backend="torch")
    ref = _per_segment(lambda xx: _conv_ref(xx, w, b), LENS, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, c in zip(_grads(out, (x, w, b)), _grads(ref, (x, w, b)), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_no_state_leaks_across_segments():
    """Changing sample A's inputs moves none of sample B's outputs (same pack, both ops); one
    segment over both (the check's negative control) does move them."""
    lens = [37, 29]
    xs = [x.detach() for x in _inputs(lens)]
    other = [x.clone() for x in xs]
    for x in other:
        x[: lens[0]] = torch.randn_like(x[: lens[0]])
    other[3][: lens[0]] = -other[3][: lens[0]].abs()  # decay stays <= 0
    cu = _cu(lens)
    b_out = gated_delta_rule_varlen(*xs, cu, backend="torch")[lens[0] :]
    b_other = gated_delta_rule_varlen(*other, cu, backend="torch")[lens[0] :]
    assert torch.equal(b_out, b_other)
    one = _cu([sum(lens)])
    leak = gated_delta_rule_varlen(*other, one, backend="torch")[lens[0] :]
    assert not torch.allclose(leak, b_out, atol=1e-3)
    x, w = xs[2].reshape(sum(lens), -1), torch.randn(24, 4)
    y = other[2].reshape(sum(lens), -1)
    assert torch.equal(
        causal_conv1d_varlen(x, w, None, cu, backend="torch")[lens[0] :],
        causal_conv1d_varlen(y, w, None, cu, backend="torch")[lens[0] :],
    )


def test_gated_rms_norm_and_backend_errors():
    x, gate, w = torch.randn(5, 8), torch.randn(5, 8), torch.randn(8)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * F.silu(gate)
    torch.testing.assert_close(gated_rms_norm(x, gate, w, 1e-6), ref)
    assert resolve_linear_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_linear_backend("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown linear-attention backend"):
        resolve_linear_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule_varlen(*_inputs([4], hk=3, hv=4), _cu([4]))


def test_fla_gets_one_int64_cu_seqlens_per_pack():
    """Every layer's kernel calls on one pack get the same int64 ``cu_seqlens`` object (fla keys
    its chunk-index cache on it: one host read per pack); another pack gets its own."""
    from lmms_kernels._linear_attention import _fla_cu

    cu, other = _cu(LENS), _cu([5, 5])
    first = _fla_cu(cu, cu.device)
    assert first.dtype == torch.long and torch.equal(first, cu.long())
    assert _fla_cu(cu, cu.device) is first
    assert _fla_cu(other, cu.device) is not first and _fla_cu(cu, cu.device) is first


def test_linear_ops_opcheck():
    """The custom ops that ``torch.compile`` sees: fakes and autograd registrations (AOT dispatch
    is the compiled test's below; the schema check runs the delta rule's many small ops under a
    checking mode, 10 s, so it checks the convolution's schema only)."""
    checks = ("test_autograd_registration", "test_faketensor")
    xs = _inputs([9, 1, 6], seed=4)
    cu = _cu([9, 1, 6])
    rule = torch.ops.lmms_kernels.delta_rule_varlen
    torch.library.opcheck(rule, (*xs, cu, 8**-0.5, True, 16, "torch"), test_utils=checks)
    out = rule(*(x.detach() for x in xs), cu, 8**-0.5, True, 16, "torch")
    torch.library.opcheck(
        torch.ops.lmms_kernels.delta_rule_varlen_backward,
        (torch.randn_like(out), *(x.detach() for x in xs), cu, 8**-0.5, True, 16, "torch"),
        test_utils=checks,
    )
    x, w, b = (torch.randn(*s).requires_grad_() for s in ((16, 6), (6, 4), (6,)))
    for bias in (None, b):
        torch.library.opcheck(
            torch.ops.lmms_kernels.conv1d_varlen,
            (x, w, bias, cu, "silu", "torch"),
            test_utils=(*checks, "test_schema"),
        )


def test_compiled_ops_match_eager_without_graph_breaks():
    """Conv then delta rule, compiled whole (``fullgraph``, dynamic shapes): values and gradients
    equal eager on packs of two lengths (the torch reference's host reads stay in the op)."""
    import torch._dynamo

    def layer(x, w, q, k, g, beta, cu):  # x [T, Hv*Dv] through the conv into v
        v = causal_conv1d_varlen(x, w, None, cu, backend="torch").reshape(x.shape[0], 4, 6)
        return gated_delta_rule_varlen(q, k, v, g, beta, cu, chunk_size=16, backend="torch")

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for lens in (LENS, [5, 40, 2]):
        q, k, _, g, beta = _inputs(lens, seed=len(lens))
        x = torch.randn(sum(lens), 24).requires_grad_()
        w = torch.randn(24, 4).requires_grad_()
        args = (x, w, q, k, g, beta, _cu(lens))
        want, got = layer(*args), compiled(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        leaves = (x, w, q, k, g, beta)
        for a, r in zip(_grads(got, leaves), _grads(want, leaves), strict=True):
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- GPU: fla against the reference

GPU_LENS = [1000, 1, 63, 64, 65, 2000, 7]  # mid-chunk ends, a length-1 sample, chunk edges


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_delta_rule_matches_torch_reference(dtype):
    pytest.importorskip("fla")
    xs = _inputs(GPU_LENS, hk=4, hv=8, dk=64, dv=64, device="cuda", dtype=dtype)
    cu = _cu(GPU_LENS, "cuda")
    out = gated_delta_rule_varlen(*xs, cu, backend="fla")
    ref = gated_delta_rule_varlen(*[x.float() for x in xs], cu, backend="torch")
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(out.float(), ref, **tol)
    g_out = _grads(out.float(), xs)
    g_ref = _grads(ref, xs)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], g_out, g_ref, strict=True):
        scale = b.float().abs().max().clamp_min(1.0)
        err = float((a.float() - b.float()).abs().max() / scale)
        assert err < (5e-2 if dtype == torch.bfloat16 else 5e-3), (name, err)


@pytest.mark.gpu
def test_fla_conv_matches_torch_reference():
    pytest.importorskip("fla")
    gen = torch.Generator().manual_seed(0)
    c = 256
    x = torch.randn(sum(GPU_LENS), c, generator=gen).cuda().requires_grad_()
    w = torch.randn(c, 4, generator=gen).cuda().requires_grad_()
    b = torch.randn(c, generator=gen).cuda().requires_grad_()
    cu = _cu(GPU_LENS, "cuda")
    for bias in (None, b):
        out = causal_conv1d_varlen(x, w, bias, cu, backend="fla")
        ref = causal_conv1d_varlen(x, w, bias, cu, backend="torch")
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        leaves = (x, w) if bias is None else (x, w, bias)
        for a, r in zip(_grads(out, leaves), _grads(ref, leaves), strict=True):
            torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-3)
