"""torch.compile of transformer blocks: varlen attention as custom ops (no graph break), Liger
patches traceable, compiled == eager in values and gradients (CPU, backend aot_eager)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _kernels_ref import LIGER_PLANS, random_cu_seqlens, tiny_model

import lmms_kernels as lk
from lmms_kernels import _liger

OP = torch.ops.lmms_kernels.varlen_attn


def _set_attn(model, name):
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None:
            cfg._attn_implementation = name
    vis = getattr(model.config, "vision_config", None)
    if vis is not None:
        vis._attn_implementation = name


def _qkv(total, h, kv, d, gen, dtype=torch.float32):
    return [torch.randn(total, n, d, generator=gen, dtype=dtype) for n in (h, kv, kv)]


def _grads(fn, q, k, v, g, *rest):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, *rest)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


# ---------------------------------------------------------------- the custom op itself


@pytest.mark.parametrize("causal", [True, False])
def test_custom_op_matches_eager_backend(causal):
    gen = torch.Generator().manual_seed(int(causal))
    for h, kv, d, total in [(4, 2, 16, 61), (2, 2, 80, 33)]:
        cu = random_cu_seqlens(total, 6, gen)
        mx = int(torch.diff(cu).max())
        q, k, v = _qkv(total, h, kv, d, gen)
        g = torch.randn(total, h, d, generator=gen)

        def eager(q, k, v, cu, mx):
            return lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend="sdpa")

        def op(q, k, v, cu, mx):
            return OP(q, k, v, cu, cu, mx, mx, causal, None, "sdpa")[0]

        want = _grads(eager, q, k, v, g, cu, mx)
        for got in (_grads(op, q, k, v, g, cu, mx), _grads(op, q, k, v, g, cu, -1)):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # flex: forward only on CPU (its eager backward is the unfused reference)
        flex = OP(q, k, v, cu, cu, mx, mx, causal, 0.3, "flex")[0]
        ref = lk.varlen_attention(
            q, k, v, cu, cu, mx, mx, causal=causal, softmax_scale=0.3, backend="sdpa"
        )
        torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_compiled_path_pads_head_dims_with_the_unpadded_scale(monkeypatch):
    """Compiled, FA4's head-dim padding happens in the traced code (Inductor fuses it): q/k/v
    zero-padded, the unpadded softmax scale, the output sliced back. Values and gradients equal
    the unpadded attention (sdpa stands in for FA4 here: "auto" is recorded as FA4 for the
    trace, the op itself still resolves to sdpa on CPU)."""
    import lmms_kernels._attention as A

    pads, real_pad = [], A._fa4_pad_to
    monkeypatch.setattr(A, "_fa4_pad_to", lambda d, dv: pads.append(real_pad(d, dv)) or pads[-1])
    gen = torch.Generator().manual_seed(3)
    total, h, kv, d = 45, 4, 2, 80
    cu = random_cu_seqlens(total, 5, gen)
    mx = int(torch.diff(cu).max())
    q, k, v = _qkv(total, h, kv, d, gen)
    g = torch.randn(total, h, d, generator=gen)

    def attend(q, k, v):
        return lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=True, backend="auto")

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    want = _grads(attend, q, k, v, g)  # eager: "auto" resolves to sdpa (and records it)
    monkeypatch.setitem(A._AUTO, "cpu", "fa4")  # as if "auto" had resolved to FA4 here
    got = _grads(compiled, q, k, v, g)  # the op itself still runs sdpa
    assert pads == [128]  # decided once, at trace time
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, k, v = _qkv(20, 4, 2, 8, gen)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu, 8, 8)
    for causal in (True, False):
        torch.library.opcheck(OP, (*args, causal, None, "sdpa"))
        torch.library.opcheck(OP, (*args, causal, 0.5, "auto"))
    bwd = torch.ops.lmms_kernels.varlen_attn_backward
    out, lse = OP(q, k, v, cu, cu, 8, 8, True, None, "sdpa")
    g = torch.randn_like(out)
    torch.library.opcheck(
        bwd, (g, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, cu, 8, 8, True, None, "sdpa")
    )  # fmt: skip


def test_compiled_attention_takes_symbolic_lengths_without_recompiling():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def fn(q, k, v, cu, mx):
        return lk.varlen_attention(q * 2, k, v, cu, cu, mx, mx, causal=True, backend="sdpa")

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    # segment counts and lengths avoid the head counts/dims: equal sizes would be duck-sized
    # into one symbol at the first trace and recompile once when they differ
    for lens in ([5, 9, 3], [11, 2, 6, 1], [4, 4, 13, 4, 4, 1]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        total, mx = sum(lens), max(lens)
        q, k, v = _qkv(total, 6, 3, 16, gen)
        g = torch.randn(total, 6, 16, generator=gen)
        want = _grads(fn, q, k, v, g, cu, mx)
        got = _grads(compiled, q, k, v, g, cu, mx)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_blocks_does_not_unify_sizes_equal_at_first_trace():
    """A pack where two unrelated sizes coincide (here the token count and the number of segment
    boundaries) must not specialise the graph on their equality: the next pack would recompile."""
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def forward(self, x, cu):
            return x * cu.float().mean() + cu.numel()

    torch._dynamo.reset()
    counters.clear()
    block = Block()
    handle = lk.compile_blocks([block], backend="eager")
    try:
        for tokens, bounds in ((5, 5), (7, 5), (9, 3), (3, 9)):
            x, cu = torch.randn(tokens, 4), torch.arange(bounds, dtype=torch.int32)
            torch.testing.assert_close(block(x, cu), Block.forward(block, x, cu))
    finally:
        handle.remove()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# ---------------------------------------------------------------- compiled transformer blocks


def _pack(gen, lens, vocab):
    ids = torch.cat([torch.randint(0, vocab, (n,), generator=gen) for n in lens])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    return ids, pos, kw


def _text_loss(model, ids, pos, kw):
    logits = model(input_ids=ids, position_ids=pos, **kw).logits[0]
    return F.cross_entropy(logits[:-1].float(), ids[0, 1:])


def _assert_grads_close(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=2e-5, msg=n)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_compiled_decoder_blocks_fullgraph_match_eager(family):
    """Every decoder block in one graph (fullgraph), on packed rows of several segments; the
    loss and every gradient equal eager; a new pack length adds no graph."""
    from torch._dynamo.utils import counters

    name = lk.register_varlen_attention("lmms_compile_test_flash", backend="auto")
    eager = tiny_model(family).train()
    _set_attn(eager, name)
    model = copy.deepcopy(eager)
    text = model.model.language_model if family == "qwen2_5_vl" else model.model
    torch._dynamo.reset()
    counters.clear()
    handle = lk.compile_blocks(list(text.layers), backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for step, lens in enumerate(([5, 9, 3, 7], [11, 2, 6], [4, 4, 4, 4, 13])):
        batch = _pack(gen, lens, 101)
        if family == "qwen2_5_vl":  # mRoPE positions: [3, 1, T]
            batch = (batch[0], batch[1].expand(3, 1, -1), batch[2])
        loss_e, loss_c = _text_loss(eager, *batch), _text_loss(model, *batch)
        torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
        loss_e.backward()
        loss_c.backward()
        _assert_grads_close(model, eager)
        eager.zero_grad()
        model.zero_grad()
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0 and sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == graphs  # new lengths reused the graphs
    handle.remove()
    assert all("forward" not in b.__dict__ for b in text.layers)


def test_compiled_vision_blocks_match_eager():
    """Qwen2.5-VL vision blocks (window + full attention, max_seqlen a 0-d tensor) compile
    whole and match eager in output and gradients."""
    name = lk.register_varlen_attention("lmms_compile_test_flash_vis", backend="sdpa")
    eager = tiny_model("qwen2_5_vl").train()
    _set_attn(eager, name)
    model = copy.deepcopy(eager)
    handle = lk.compile_blocks(list(model.model.visual.blocks), backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for grid in ([[1, 4, 4], [1, 4, 8]], [[1, 8, 8]]):
        grid = torch.tensor(grid)
        n = int(grid.prod(-1).sum())
        pix = torch.randn(n, 3 * 2 * 14 * 14, generator=gen)
        outs = []
        for m in (eager, model):
            out = m.model.visual(pix, grid_thw=grid)
            out = getattr(out, "pooler_output", out)
            outs.append(out)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        _assert_grads_close(model.model.visual, eager.model.visual)
        eager.zero_grad()
        model.zero_grad()
    handle.remove()


def test_liger_patched_blocks_compile_with_upstream_math(monkeypatch):
    """Liger-patched RMSNorm/SwiGLU run their upstream forward inside compiled blocks (no
    trace into Liger's Triton launchers), and Liger's ops outside them."""
    calls = {"rms": 0, "swiglu": 0}

    def rms(x, w, eps, offset, casting):
        assert (offset, casting) == (0.0, "llama")  # the qwen2 plan's numerics
        calls["rms"] += 1
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def swiglu(a, b):
        calls["swiglu"] += 1
        return F.silu(a) * b

    monkeypatch.setattr(_liger, "_liger_ops", lambda: (rms, swiglu))
    monkeypatch.setattr(_liger, "_use_liger", lambda x: True)
    name = lk.register_varlen_attention("lmms_compile_test_liger", backend="sdpa")
    model = tiny_model("qwen2").train()
    _set_attn(model, name)
    handle = lk.apply_liger(model, LIGER_PLANS["qwen2"])
    batch = _pack(torch.Generator().manual_seed(2), [6, 3, 8], 101)
    eager_loss = _text_loss(model, *batch)
    assert calls["rms"] > 0 and calls["swiglu"] > 0
    compiled = lk.compile_blocks(list(model.model.layers), backend="aot_eager", fullgraph=True)
    calls.update(rms=0, swiglu=0)
    loss = _text_loss(model, *batch)
    # the final norm is outside the compiled blocks: exactly one Liger call remains
    assert calls == {"rms": 1, "swiglu": 0}
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    compiled.remove()
    handle.remove()


def test_fa4_variants_reads_fa4s_compile_caches(monkeypatch):
    """Without FA4 (CPU) there is nothing to count; with its interface imported, every compile
    cache's entries are counted (FA4 itself runs only on the GPU: its GPU test calls it)."""
    import sys
    import types

    monkeypatch.delitem(sys.modules, "flash_attn.cute.interface", raising=False)
    assert lk.fa4_variants() is None

    class JITCache:  # FA4's layout: the compiled functions in a dict under `.cache`
        def __init__(self, n):
            self.cache = {("key", i): object() for i in range(n)}

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = lambda: None
    interface._flash_attn_fwd.compile_cache = JITCache(3)
    interface._flash_attn_bwd = lambda: None
    interface._flash_attn_bwd.compile_cache = JITCache(2)
    interface._compute_tile_cumsum = lambda: None  # a helper kernel's cache counts too
    interface._compute_tile_cumsum.compile_cache = JITCache(1)
    interface.flash_attn_varlen_func = lambda: None  # no cache: not counted
    interface.CompileKey = tuple  # a class, not a kernel
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    assert lk.fa4_variants() == 6
    interface._flash_attn_bwd.compile_cache = object()  # a layout it does not know
    assert lk.fa4_variants() is None


def test_new_fa4_kernels_are_described_by_the_key_fields_they_changed(monkeypatch):
    """A snapshot of FA4's keys before and after a step: each new key is shown against the held
    key of its cache that differs in the fewest places (what a new size switched)."""
    import sys
    import types

    monkeypatch.delitem(sys.modules, "flash_attn.cute.interface", raising=False)
    assert lk.fa4_kernel_keys() is None
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_bwd = lambda: None
    bwd = {("bf16", 128, False, False): 0, ("bf16", 96, True, False): 1}
    interface._flash_attn_bwd.compile_cache = types.SimpleNamespace(cache=bwd)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    before = lk.fa4_kernel_keys()
    assert before == {"_flash_attn_bwd": frozenset(bwd)}
    assert lk.describe_new_fa4_kernels(before, lk.fa4_kernel_keys()) == []
    bwd[("bf16", 128, False, True)] = 2  # nearest held key: the first, one place apart
    interface._flash_attn_fwd = lambda: None
    interface._flash_attn_fwd.compile_cache = {("fwd", 1): 0}  # a cache seen for the first time
    lines = lk.describe_new_fa4_kernels(before, lk.fa4_kernel_keys())
    assert lines == [
        "_flash_attn_bwd: new key, key[3]: False -> True",
        "_flash_attn_fwd: first kernel of its kind, key ('fwd', 1)",
    ]
