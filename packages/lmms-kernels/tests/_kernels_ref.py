"""Shared helpers for the lmms-kernels tests: random packings and a dense masked reference, and
the fused linear cross-entropy's random cases and its check against logits + cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_cu_seqlens(total: int, n_max: int, gen: torch.Generator) -> torch.Tensor:
    """Random segment boundaries covering [0, total] with 1..n_max segments (all non-empty)."""
    n = int(torch.randint(1, min(n_max, total) + 1, (1,), generator=gen))
    cuts = torch.randperm(total - 1, generator=gen)[: n - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([total])]).to(torch.int32)


def fwd_bwd(fn, q, k, v, grad) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` of ``fn(q, k, v)`` on fresh leaves, backward from ``grad``."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def cuda_attention_cases(backend: str, head_dim: int, causal: bool):
    """Two packed bf16 CUDA cases for ``backend`` (the test is skipped where it is not
    installed), GQA (8 query / 2 kv heads, 700 tokens) and MHA (4 / 4, 257), each a random
    packing of up to 9 segments, seeded by the case: yields ``(h, kv, cu, max_len, q, k, v,
    grad)``."""
    import pytest

    import lmms_kernels as lk

    if backend not in lk.available_backends("cuda"):
        pytest.skip(f"{backend} not installed")
    gen = torch.Generator().manual_seed(head_dim + causal)
    for h, kv, total in [(8, 2, 700), (4, 4, 257)]:
        cu = random_cu_seqlens(total, 9, gen).cuda()
        mx = int(torch.diff(cu).max())
        q, k, v, g = (
            torch.randn(total, n, head_dim, generator=gen).cuda().bfloat16() for n in (h, kv, kv, h)
        )
        yield h, kv, cu, mx, q, k, v, g


def dense_reference(
    q, k, v, cu_q, cu_k, *, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """Full [T, T] block-diagonal (optionally causal, bottom-right aligned) masked attention."""
    tq, tk = q.shape[0], k.shape[0]
    doc_q = torch.searchsorted(cu_q[1:].long(), torch.arange(tq), right=True)
    doc_k = torch.searchsorted(cu_k[1:].long(), torch.arange(tk), right=True)
    mask = doc_q[:, None] == doc_k[None, :]
    if causal:
        rel_q = torch.arange(tq) - cu_q.long()[doc_q]
        rel_k = torch.arange(tk) - cu_k.long()[doc_k]
        len_q, len_k = torch.diff(cu_q.long())[doc_q], torch.diff(cu_k.long())[doc_q]
        mask &= rel_k[None, :] <= (rel_q + len_k - len_q)[:, None]
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        kk.transpose(0, 1).float(),
        vv.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


_TEXT = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)
_VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
TINY_CONFIGS = {
    "qwen2": dict(_TEXT),
    "qwen3": dict(_TEXT),
    "qwen3_moe": dict(
        _TEXT,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "qwen2_5_vl": dict(
        text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(_VISION, window_size=28, fullatt_block_indexes=[1]),
    ),
    "qwen3_vl": dict(
        text_config=dict(
            _TEXT,
            rope_scaling={
                "rope_type": "default",
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16),
    ),
}


#: The Liger plans of the tiny models' transformers classes (as lmms-models' families state them).
_LLAMA = {"rms_casting": "llama"}  # Liger's mode: w * (x_fp32 * rstd).to(dtype)
LIGER_PLANS = {
    "qwen2": {"rms_norm": ("Qwen2RMSNorm",), "mlp": ("Qwen2MLP",), **_LLAMA},
    "qwen3": {"rms_norm": ("Qwen3RMSNorm",), "mlp": ("Qwen3MLP",), **_LLAMA},
    "qwen3_moe": {
        "rms_norm": ("Qwen3MoeRMSNorm",),
        "mlp": ("Qwen3MoeMLP",),
        "mlp_optional": True,
        **_LLAMA,
    },
    "qwen2_5_vl": {
        "rms_norm": ("Qwen2_5_VLRMSNorm",),
        "mlp": ("Qwen2MLP", "Qwen2_5_VLMLP"),
        **_LLAMA,
    },
    "qwen3_vl": {"rms_norm": ("Qwen3VLTextRMSNorm",), "mlp": ("Qwen3VLTextMLP",), **_LLAMA},
    "qwen3_5": {
        "rms_norm": ("Qwen3_5RMSNorm",),
        "mlp": ("Qwen3_5MLP",),
        "rms_offset": 1.0,
        "rms_casting": "gemma",
    },
}


def tiny_model(family: str, seed: int = 0, dtype=torch.float32):
    """A randomly initialised tiny model of ``family`` (a transformers model type)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **TINY_CONFIGS[family])
    cfg.use_cache = False
    cls = AutoModelForImageTextToText if family.endswith("_vl") else AutoModelForCausalLM
    return cls.from_config(cfg, dtype=dtype)


def text_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a plain text batch (also for VL models: no images)."""
    return model(input_ids=ids).logits


# ---------------------------------------------------------------- fused linear cross-entropy

FLCE_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def flce_case(t, hd, v, dtype, gen, *, frac_ignored=0.3, ignore_index=-100, bias=False):
    """Hidden states [t, hd], weight [v, hd], optional bias [v] (all requiring grad), labels [t]
    with about `frac_ignored` of them `ignore_index`."""
    h = (torch.randn(t, hd, generator=gen) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, hd, generator=gen) * 0.2).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (t,), generator=gen)
    y[torch.rand(t, generator=gen) < frac_ignored] = ignore_index
    return h, w, b, y


def check_flce(loss, n, h, w, b, y, *, ignore_index=-100, grad_scale=0.5):
    """`(loss, n)` of a fused linear cross-entropy against fp32 logits + summed cross-entropy:
    dtypes, token count, value, and the gradients of `loss * grad_scale` for h, w (and b)."""
    dtype = h.dtype
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert n.dtype == torch.int64 and int(n) == int((y != ignore_index).sum())
    logits = h.float() @ w.float().T + (b.float() if b is not None else 0)
    ref = F.cross_entropy(logits, y, reduction="sum", ignore_index=ignore_index)
    torch.testing.assert_close(loss, ref, **FLCE_TOL[dtype])
    params = [x for x in (h, w, b) if x is not None]
    grads = torch.autograd.grad(loss * grad_scale, params)
    refs = torch.autograd.grad(ref * grad_scale, params)
    for g, r in zip(grads, refs, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r.float(), **FLCE_TOL[dtype])


def check_flce_frozen_weight_and_no_grad(h, w, y, backend):
    """A frozen weight gets no gradient (the hidden states do), and under `no_grad` the loss is
    the same value."""
    import lmms_kernels as lk

    w.requires_grad_(False)
    loss, _ = lk.fused_linear_cross_entropy(h, w, y, backend=backend)
    loss.backward()
    assert w.grad is None and h.grad is not None
    with torch.no_grad():
        again, _ = lk.fused_linear_cross_entropy(h, w, y, backend=backend)
    torch.testing.assert_close(again, loss.detach())


def check_flce_weighted(backend, dtype, gen, *, t=37, hd=24, v=1000, bias=False, **kw):
    """``token_weights`` and ``token_stats`` of a fused linear cross-entropy against fp32 logits:
    the weighted sum ``Σ w_i CE_i`` and its gradients, the unweighted per-token losses, and the
    argmax hits (ignored rows: loss 0, no hit)."""
    import lmms_kernels as lk

    h, w, b, y = flce_case(t, hd, v, dtype, gen, frac_ignored=0.2, bias=bias)
    tw = torch.rand(t, generator=gen) * 4 + 0.5  # [t] fp32, like 1/t weights
    logits = h.float() @ w.float().T + (b.float() if b is not None else 0)
    y[0] = int(logits[0].argmax())  # at least one hit
    loss, n, rows, hit = lk.fused_linear_cross_entropy(
        h, w, y, bias=b, backend=backend, token_weights=tw, token_stats=True, **kw
    )
    ref_rows = F.cross_entropy(logits, y, reduction="none", ignore_index=-100)  # [t]
    ref = (ref_rows * tw).sum()
    tol = FLCE_TOL[dtype]
    torch.testing.assert_close(loss, ref, **tol)
    assert int(n) == int((y != -100).sum())
    torch.testing.assert_close(rows, ref_rows.detach(), **tol)
    assert not rows.requires_grad and not hit.requires_grad and hit.dtype == torch.bool
    valid = y != -100
    ref_hit = valid & (logits.gather(1, y.clamp(min=0)[:, None]).squeeze(1) >= logits.amax(-1))
    assert hit[0] and torch.equal(hit, ref_hit) if dtype == torch.float32 else hit[0]
    params = [x for x in (h, w, b) if x is not None]
    grads = torch.autograd.grad(loss * 0.37, params)
    refs = torch.autograd.grad(ref * 0.37, params)
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g.float(), r.float(), **tol)
    # the weights change the gradients (the check can fail): unweighted differs
    plain, _ = lk.fused_linear_cross_entropy(h, w, y, bias=b, backend=backend, **kw)
    assert not torch.allclose(plain, loss)


def check_flce_rows(backend, dtype, gen, *, v, memory_budget_bytes=None, bias=False):
    """``rows=labelled_rows(labels)`` against the full-row path, same backend: the loss, the
    gradients and ``token_stats`` to the order of fp32 sums (a GEMM of T_l rows may block its
    sums differently from one of T rows, and the chunks fall differently), exact zeros on the
    unlabelled rows' hidden gradient both ways. Packs: a prompt-then-answer
    layout (unlabelled first half), scattered labels with token weights and stats, and a pack
    with no labelled row at all."""
    import lmms_kernels as lk

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for layout in ("prompt_answer", "scattered", "none"):
        h, w, b, y = flce_case(29, 16, v, dtype, gen, frac_ignored=0.4, bias=bias)
        if layout == "prompt_answer":
            y[:15] = -100
        elif layout == "none":
            y[:] = -100
        tw = torch.rand(29, generator=gen) + 0.5 if layout == "scattered" else None
        rows = lk.labelled_rows(y)
        assert rows.dtype == torch.int64 and rows.numel() == int((y != -100).sum())
        params = [x for x in (h, w, b) if x is not None]
        got, want = [], []
        for r, out in ((None, want), (rows, got)):
            res = lk.fused_linear_cross_entropy(
                h, w, y, bias=b, backend=backend, memory_budget_bytes=memory_budget_bytes,
                token_weights=tw, token_stats=tw is not None, rows=r,
            )  # fmt: skip
            out += [*res, *torch.autograd.grad(res[0] * 0.75, params)]
        (loss, n, *rest), (loss0, n0, *rest0) = got, want
        assert int(n) == int(n0) and loss.dtype == torch.float32
        torch.testing.assert_close(loss, loss0, atol=1e-6, rtol=1e-6)
        if tw is not None:  # [T] stats, zero outside the rows
            torch.testing.assert_close(rest[0], rest0[0], atol=1e-5, rtol=1e-5)
            assert torch.equal(rest[1], rest0[1]) and not rest[1][y == -100].any()
            assert torch.count_nonzero(rest[0][y == -100]) == 0
            rest, rest0 = rest[2:], rest0[2:]
        off = y == -100  # unlabelled rows: exact zeros on both paths
        assert torch.count_nonzero(rest[0][off]) == 0 and torch.count_nonzero(rest0[0][off]) == 0
        for g, g0 in zip(rest, rest0, strict=True):
            assert g.dtype == g0.dtype
            torch.testing.assert_close(g.float(), g0.float(), **tol)
        if layout == "none":
            assert float(loss.detach()) == 0.0 and all(torch.count_nonzero(g) == 0 for g in rest)
