"""LowPrecisionAdamW's Triton backend against its torch backend; run under TRITON_INTERPRET=1 on
CPU (CI, through test_lowp_adamw.py) or on a GPU (`python lowp_triton_checks.py cuda`)."""

import copy
import sys

import torch

from lmms_optim import LowPrecisionAdamW


def _params(dev, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 29), (11,), (3000,)]  # several blocks, a partial last one
    ps = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dev, dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dev) for s in shapes] for _ in range(4)]
    return ps, grads


def _run(opt, ps, grads, clip=False):
    for g in grads:
        for p, x in zip(ps, g, strict=True):
            p.grad = x.to(torch.bfloat16).to(p.dtype)  # bf16-exact values in p.grad's dtype
        if clip:
            opt.clip_norm_(0.5)
        opt.step()


def fp32_state_matches_torch(dev):
    kw = dict(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32)
    a, grads = _params(dev, torch.float32)
    b, _ = _params(dev, torch.float32)
    _run(LowPrecisionAdamW(a, backend="triton", **kw), a, grads, clip=True)
    _run(LowPrecisionAdamW(b, backend="torch", **kw), b, grads, clip=True)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)


def stochastic_rounding_tracks_the_second_moment(dev):
    # beta2 0.99, grad 1: v_t = 1 - 0.99^t; bf16 rounded to nearest stalls near 0.84
    want = 1 - 0.99**300
    got = {}
    for rounding in ("stochastic", "nearest"):
        p = torch.nn.Parameter(torch.zeros(1024, device=dev))
        opt = LowPrecisionAdamW([p], lr=0.0, weight_decay=0.0, betas=(0.9, 0.99),
                                rounding=rounding, backend="triton")  # fmt: skip
        p.grad = torch.ones(1024, device=dev)
        for _ in range(300):
            opt.step()
        got[rounding] = opt.state[p]["exp_avg_sq"].float().mean().item()
    assert abs(got["stochastic"] - want) < 0.01 * want, got
    assert abs(got["nearest"] - want) > 0.05 * want, got


def resume_is_exact_with_bf16_weights(dev):
    kw = dict(lr=1e-2, weight_decay=0.01, seed=5, backend="triton")
    a, grads = _params(dev, torch.bfloat16)
    opt = LowPrecisionAdamW(a, **kw)
    _run(opt, a, grads[:2])
    saved, at2 = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in a]
    _run(opt, a, grads[2:])
    b = [torch.nn.Parameter(x.clone()) for x in at2]
    opt2 = LowPrecisionAdamW(b, **kw)
    opt2.load_state_dict(saved)
    _run(opt2, b, grads[2:])
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    c, _ = _params(dev, torch.bfloat16)
    _run(LowPrecisionAdamW(c, **{**kw, "seed": 6}), c, grads)
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    for st in opt.state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    # the weights moved by about what the fp32 reference moved them (SR: right in expectation)
    d, _ = _params(dev, torch.float32)
    _run(torch.optim.AdamW(d, lr=1e-2, weight_decay=0.01, foreach=False), d, grads)
    start, _ = _params(dev, torch.float32)
    for x, y, s0 in zip(a, d, start, strict=True):
        moved, ref = (x.float() - s0).norm(), (y - s0).norm()
        assert abs(moved / ref - 1) < 0.05, (float(moved), float(ref))


def fused_matches_per_parameter(dev):
    """One launch per group (`lmms_optim._lowp_multi`) == one kernel per parameter, bit for
    bit: bf16 moments over fp32 masters writing bf16 mirrors, and bf16 weights; two groups,
    a parameter of two chunks, the clip scale; mirrors equal the masters rounded to nearest."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(37, 29), (11,), (9000,)]  # 9000: two chunks of the fused kernel
    for dtype in (torch.float32, torch.bfloat16):
        start = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
        grads = [[torch.randn(s, generator=gen).to(dev) for s in shapes] for _ in range(3)]
        runs = []
        for fused in (True, False):
            ps = [torch.nn.Parameter(x.to(dev, dtype, copy=True)) for x in start]
            groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
            opt = LowPrecisionAdamW(groups, lr=1e-2, weight_decay=0.1, seed=3, backend="triton",
                                    fused=fused)  # fmt: skip
            mirrors = {id(p): torch.zeros_like(p, dtype=torch.bfloat16) for p in ps}
            if dtype == torch.float32:
                opt.set_mirrors(mirrors)
            _run(opt, ps, grads, clip=True)
            runs.append((ps, opt, mirrors))
        (a, oa, ma), (b, ob, mb) = runs
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), dtype
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(oa.state[x][key], ob.state[y][key]), (dtype, key)
            if dtype == torch.float32 and dev == "cuda":
                assert torch.equal(ma[id(x)], mb[id(y)])
                assert torch.equal(ma[id(x)], x.detach().to(torch.bfloat16))
            elif dtype == torch.float32:  # the interpreter's bf16 cast truncates: one ulp
                torch.testing.assert_close(ma[id(x)], x.detach().to(torch.bfloat16))
        assert not torch.equal(a[0], start[0].to(dev, dtype))


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    fp32_state_matches_torch(dev)
    stochastic_rounding_tracks_the_second_moment(dev)
    resume_is_exact_with_bf16_weights(dev)
    fused_matches_per_parameter(dev)
    print("ok")
