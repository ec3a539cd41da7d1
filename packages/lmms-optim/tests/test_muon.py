import copy

import pytest
import torch
from optim_reference import assert_ns_close, muon_step, rel, scale
from torch import nn

import lmms_optim as lo

SHAPES = [(12, 20), (20, 12), (16, 16), (12, 20), (6, 2, 3)]  # repeated shape -> batched NS


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


@pytest.mark.parametrize("adjust_lr", [None, "original", "rms", "spectral"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_published_algorithm(adjust_lr, nesterov):
    params = _params()
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    kw = dict(lr=0.03, momentum=0.9, nesterov=nesterov, weight_decay=0.1, adjust_lr=adjust_lr)
    groups = [{"params": params, "use_muon": True}]  # includes one 3-D kernel (flattened)
    opt = lo.Muon(groups, **kw)
    for step in range(3):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _grads(params, step)):
            p.grad = g.clone()
        opt.step()
        for p, p0, b, g in zip(params, before, bufs, _grads(params, step)):
            # the published step on the same starting point
            r = p0.clone()
            u = g.lerp(b.lerp(g, 0.1), 0.9) if nesterov else b.lerp(g, 0.1)
            muon_step(
                r, g, b, lr=0.03, momentum=0.9, nesterov=nesterov, wd=0.1, adjust_lr=adjust_lr
            )
            assert rel(p.detach() - p0, r - p0) < 0.08
            # recover our orthogonalised update exactly and hold it to bf16 NS tolerance
            s = 0.03 * scale(adjust_lr, p.shape)
            o = (p0 * (1 - 0.03 * 0.1) - p.detach()) / s
            assert_ns_close(o.reshape(len(o), -1).bfloat16(), u.reshape(len(u), -1))
    for p, b in zip(params, bufs):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b)


def test_plain_param_list_splits_and_adamw_matches_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = lo.Muon(model.parameters(), lr=0.02, adamw_lr=1e-2, adamw_betas=(0.8, 0.9),
                  adamw_eps=1e-6, adamw_weight_decay=0.05)  # fmt: skip
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert all(p.ndim == 2 for p in opt.param_groups[0]["params"])
    others = [p for p in twin.parameters() if p.ndim != 2]
    ref = torch.optim.AdamW(others, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    x = torch.randn(32, 8)
    for _ in range(4):
        for m in (model, twin):
            m.zero_grad()
            m(x).square().mean().backward()
        opt.step()
        ref.step()
        with torch.no_grad():  # matrices follow Muon in both, so gradients stay equal
            for p, q in zip(model.parameters(), twin.parameters()):
                if p.ndim == 2:
                    q.copy_(p)
        for p, q in zip([p for p in model.parameters() if p.ndim != 2], others):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            # state keys match torch's, so tools that read AdamW state keep working
            assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8, bias=False))
        self.norm = nn.RMSNorm(8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.head = nn.Linear(8, 11, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        h = self.block(self.embed(x))
        h = h + self.conv(h.T.unsqueeze(0)).squeeze(0).T.mean(0)
        return self.head(self.norm(h))


def test_param_groups_for_a_model():
    m = _Tiny()
    groups = lo.build_muon_param_groups(m, lr=0.02, weight_decay=0.1, adamw_lr=3e-4,
                                        adamw_weight_decay=0.01, adamw_patterns=())  # fmt: skip
    by = {g["name"]: {id(p) for p in g["params"]} for g in groups}
    ids = lambda *ps: {id(p) for p in ps}  # noqa: E731
    assert by["muon"] == ids(m.block[0].weight, m.block[2].weight)
    assert by["adamw"] == ids(m.embed.weight, m.head.weight, m.conv.weight)
    assert by["adamw_no_decay"] == ids(m.block[0].bias, m.norm.weight, m.conv.bias)
    g = {g["name"]: g for g in groups}
    assert g["adamw"]["lr"] == 3e-4 and g["adamw_no_decay"]["weight_decay"] == 0.0
    # overridable: conv kernels can go to Muon, extra modules forced to AdamW
    groups = lo.build_muon_param_groups(m, muon_for_conv=True, adamw_modules=[m.block[2]])
    by = {g["name"]: {id(p) for p in g["params"]} for g in groups}
    assert by["muon"] == ids(m.block[0].weight, m.conv.weight)
    # trains: loss goes down with the combined optimizer, conv kernel included
    opt = lo.Muon(groups, lr=0.02, adjust_lr="rms")
    x = torch.randint(0, 11, (24,))
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(m(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_state_dict_round_trip():
    torch.manual_seed(0)
    m = _Tiny()
    x = torch.randint(0, 11, (24,))

    def run(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), x).backward()
            opt.step()

    opt = lo.Muon(lo.build_muon_param_groups(m), lr=0.02, adjust_lr="rms")
    run(m, opt, 2)
    saved_model, saved_opt = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())
    run(m, opt, 2)
    m2 = _Tiny()
    m2.load_state_dict(saved_model)
    opt2 = lo.Muon(lo.build_muon_param_groups(m2), lr=0.5)  # hyperparameters come from the save
    opt2.load_state_dict(saved_opt)
    assert opt2.param_groups[0]["lr"] == 0.02 and opt2.param_groups[0]["adjust_lr"] == "rms"
    run(m2, opt2, 2)
    for a, b in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_errors():
    with pytest.raises(ValueError, match="adjust_lr"):
        lo.Muon([nn.Parameter(torch.zeros(2, 2))], adjust_lr="bogus")
    with pytest.raises(ValueError, match="ndim >= 2"):
        lo.Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])
    assert lo.lr_scale("rms", (4, 16)) == pytest.approx(0.8)
    assert lo.lr_scale("spectral", (4, 16)) == pytest.approx(0.5)
    assert lo.lr_scale("original", (16, 4)) == pytest.approx(2.0)


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_muon_methods_match_published_step(method):
    """Muon with either NS method (wide, tall — no transpose — and a stacked pair) equals the
    published per-matrix step within bf16 tolerance."""
    g = torch.Generator().manual_seed(7)
    shapes = [(16, 64), (64, 16), (64, 16), (6, 4, 5)]
    params = [nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in shapes]
    groups = [{"params": params, "use_muon": True}]
    opt = lo.Muon(groups, lr=0.03, weight_decay=0.1, adjust_lr="rms", ns_method=method)
    assert opt.ns_method == method
    bufs = [torch.zeros_like(p) for p in params]
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        before = [p.detach().clone() for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for p, p0, b, gr in zip(params, before, bufs, grads):
            r = p0.clone()
            muon_step(r, gr, b, lr=0.03, momentum=0.95, nesterov=True, wd=0.1, adjust_lr="rms")
            assert rel(p.detach() - p0, r - p0) < 0.06
    with pytest.raises(ValueError, match="method"):
        lo.Muon(params, ns_method="fast")  # type: ignore[arg-type]


def test_one_rank_fsdp_takes_the_batched_local_path(monkeypatch):
    """FSDP2 on one rank: each DTensor holds its whole matrix, so Muon must batch it with the
    same-shaped ones (like plain tensors) instead of the per-matrix distributed path, and give
    the plain-tensor result."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def train(model, steps=3):
        opt = lo.Muon(lo.build_muon_param_groups(model, lr=0.02, weight_decay=0.1), lr=0.02)
        x = torch.randint(0, 11, (24,), generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), x).backward()
            opt.step()
        return {
            k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in model.state_dict().items()
        }

    torch.manual_seed(0)
    plain = _Tiny()
    sharded = copy.deepcopy(plain)
    expected = train(plain)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        assert any(hasattr(p, "placements") for p in sharded.parameters())

        def no_gather(self, items):
            raise AssertionError("a whole-matrix DTensor went through the per-matrix gather path")

        monkeypatch.setattr(lo.Muon, "_orthogonalize", no_gather)
        got = train(sharded)
    finally:
        if owns:
            dist.destroy_process_group()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0)


@pytest.mark.parametrize("adjust_lr", [None, "rms"])
def test_stacked_group_orthogonalises_each_matrix(adjust_lr):
    """A `stacked` group ([S, m, n], e.g. MoE experts) == the same S matrices as separate 2-D
    parameters, bit for bit, over three steps (momentum, NS, per-matrix lr scale)."""
    gen = torch.Generator().manual_seed(3)
    stack = torch.nn.Parameter(torch.randn(3, 12, 20, generator=gen))
    alone = [torch.nn.Parameter(stack.detach()[i].clone()) for i in range(3)]
    opt_s = lo.Muon([{"params": [stack], "use_muon": True, "stacked": True}], lr=0.05,
                    adjust_lr=adjust_lr)  # fmt: skip
    opt_a = lo.Muon([{"params": alone, "use_muon": True}], lr=0.05, adjust_lr=adjust_lr)
    for _ in range(3):
        g = torch.randn(3, 12, 20, generator=gen)
        stack.grad = g.clone()
        for i, p in enumerate(alone):
            p.grad = g[i].clone()
        opt_s.step()
        opt_a.step()
    for i, p in enumerate(alone):
        assert torch.equal(stack.detach()[i], p.detach())
    # the flag matters: without it the stack is one [3, 240] matrix (another update)
    one = {}
    for stacked in (True, False):
        p = torch.nn.Parameter(torch.zeros(3, 12, 20))
        p.grad = g.clone()
        lo.Muon([{"params": [p], "use_muon": True, "stacked": stacked}], lr=0.05).step()
        one[stacked] = p.detach()
    assert not torch.allclose(one[True], one[False], atol=1e-3)
