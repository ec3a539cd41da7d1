"""CUDA: the varlen custom op per installed backend equals the eager backend call (forward and
backward), and Inductor-compiled blocks equal eager blocks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _kernels_ref import cuda_attention_cases, fwd_bwd, random_cu_seqlens, tiny_model

import lmms_kernels as lk

pytestmark = pytest.mark.gpu

OP = torch.ops.lmms_kernels.varlen_attn


@pytest.mark.parametrize("backend", ["fa4", "torch", "fa", "flex"])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("causal", [True, False])
def test_custom_op_matches_eager_backend_gpu(backend, head_dim, causal):
    for h, kv, cu, mx, q, k, v, g in cuda_attention_cases(backend, head_dim, causal):

        def eager(q, k, v, cu=cu, mx=mx):
            return lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend=backend)

        def op(q, k, v, cu=cu, mx=mx):
            return OP(q, k, v, cu, cu, mx, mx, causal, None, backend)[0]

        want, got = fwd_bwd(eager, q, k, v, g), fwd_bwd(op, q, k, v, g)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(
                a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=f"{backend} {name} {h=} {kv=}"
            )


@pytest.mark.parametrize("head_dim", [80, 128])
def test_compiled_fa4_pads_head_dims_in_the_trace_gpu(head_dim):
    """Inductor-compiled `varlen_attention` on FA4 pads q/k/v in the traced code (head dim 80:
    Qwen2.5-VL's vision tower) and equals the eager call, which pads inside the kernel call."""
    if "fa4" not in lk.available_backends("cuda"):
        pytest.skip("fa4 not installed")
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(head_dim)
    total, h = 900, 16
    cu = random_cu_seqlens(total, 7, gen).cuda()
    mx = int(torch.diff(cu).max())
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).cuda().bfloat16() for _ in range(3))
    g = torch.randn(total, h, head_dim, generator=gen).cuda().bfloat16()

    def attend(q, k, v):
        return lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=False, backend="fa4")

    compiled = torch.compile(attend, fullgraph=True)
    want, got = fwd_bwd(attend, q, k, v, g), fwd_bwd(compiled, q, k, v, g)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=name)


def _set_attn(model, name):
    for attr in ("text_config", "vision_config"):
        sub = getattr(model.config, attr, None)
        if sub is not None:
            sub._attn_implementation = name
    model.config._attn_implementation = name


def _assert_grads_close(a, b, tol):
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=tol, rtol=tol, msg=n)


def test_inductor_compiled_blocks_match_eager_gpu():
    """Qwen2.5-VL tiny (bf16, CUDA, auto backend): decoder and vision blocks compiled with
    Inductor equal eager in loss and gradients, over two packs of different lengths."""
    from torch._dynamo.utils import counters

    name = lk.register_varlen_attention("lmms_compile_gpu_flash")
    eager = tiny_model("qwen2_5_vl").cuda().bfloat16().train()
    _set_attn(eager, name)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    blocks = list(model.model.visual.blocks) + list(model.model.language_model.layers)
    lk.compile_blocks(blocks, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for lens, grid in (([50, 90, 33, 70], [[1, 4, 4], [1, 4, 8]]), ([110, 21, 60], [[1, 8, 8]])):
        ids = torch.cat([torch.randint(0, 101, (n,), generator=gen) for n in lens])[None].cuda()
        pos = torch.cat([torch.arange(n) for n in lens])[None].expand(3, 1, -1).cuda()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
        kw = dict(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens)
        )
        grid = torch.tensor(grid).cuda()
        pix = (
            torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen).cuda().bfloat16()
        )
        losses = []
        for m in (eager, model):
            logits = m(input_ids=ids, position_ids=pos, **kw).logits[0]
            loss = F.cross_entropy(logits[:-1].float(), ids[0, 1:])
            vis = m.model.visual(pix, grid_thw=grid)
            vis = getattr(vis, "pooler_output", vis)
            loss = loss + vis.float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=2e-2, rtol=2e-2)
        _assert_grads_close(model, eager, 5e-2)
        eager.zero_grad()
        model.zero_grad()
    assert sum(counters["graph_break"].values()) == 0
