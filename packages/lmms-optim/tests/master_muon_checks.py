"""MasterMuon's Triton path against the three-pass step (clip_grad_norm_, Muon.step, copy of the
masters into bf16); run under TRITON_INTERPRET=1 on CPU (CI) or on a GPU:
`python master_muon_checks.py cpu|cuda [big]`. Prints one line per check. Also `dist_worker`,
the FSDP2 check spawned by test_master_muon.py (importable by spawned children).

What is exact and what is not: the momentum kernel and the apply kernel do torch's arithmetic
operation for operation, so the momentum buffers, the bf16 NS stack and the applied masters equal
the reference bit for bit (CPU; on CUDA within an fp32 ulp). The Frobenius norm is summed in
another order than ``torch.linalg.vector_norm``: where the two differ by an ulp, a bf16 rounding
inside NS may flip and that matrix's update then differs at the bf16 noise of NS (~1%). So the
updates are checked bitwise in most matrix-steps and within bf16 tolerance in all.
"""

from __future__ import annotations

import copy
import sys

import torch

from lmms_optim import MasterMuon, Muon
from lmms_optim._muon_kernels import (
    apply_,
    apply_reference,
    momentum_stack_,
    momentum_stack_reference,
    n_partials,
)

SMALL = [(24, 40), (40, 24), (32, 32), (24, 40), (3, 4, 5)]  # tall, wide, square, a stack, 3-D
BIG = [(2048, 11008), (11008, 2048), (2048, 2048), (2048, 2048)]
ADAMW = [(300, 70), (9,)]  # through flat_adamw_ (small_numel lowered) and torch's fused AdamW


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_kernels(device: str) -> list[str]:
    exact = device == "cpu"  # CUDA: within an ulp (the reference's lerp may not fuse the same)
    done = []
    g = torch.Generator().manual_seed(0)
    for n in (1, 37 * 53, 9000):  # one element, ragged, several programs
        for grad_dtype in (torch.float32, torch.bfloat16):
            for scale in (None, 0.37):
                for momentum, nesterov in ((0.95, True), (0.95, False), (0.3, True)):
                    grad = torch.randn(n, generator=g).to(device, grad_dtype)
                    buf = torch.randn(n, generator=g).to(device)
                    s = None if scale is None else torch.tensor(scale, device=device)
                    ref_buf, ref_x = (
                        buf.clone(),
                        torch.empty(n, device=device, dtype=torch.bfloat16),
                    )
                    x = torch.empty_like(ref_x)
                    partials = torch.empty(n_partials(n), device=device)
                    kw = dict(momentum=momentum, nesterov=nesterov)
                    momentum_stack_(grad, buf, x, partials, s, **kw)
                    sumsq = momentum_stack_reference(grad, ref_buf, ref_x, s, **kw)
                    if exact:
                        assert torch.equal(buf, ref_buf) and torch.equal(x, ref_x), (n, scale)
                    else:
                        assert_ulp_close(buf, ref_buf)
                        torch.testing.assert_close(x, ref_x, rtol=2**-8, atol=0)
                    torch.testing.assert_close(partials.sum(), sumsq, rtol=1e-5, atol=0)
        done.append(f"momentum kernel n={n}")
    # apply: bf16 rounding of ties, negatives, subnormals, inf and NaN, as torch rounds
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -(2**-133) * 3,
                            float("inf"), float("nan"), 3.4e38, -0.0])  # fmt: skip
    for n in (9, 5000):
        for folded, decay in ((True, 1.0), (True, 0.998), (False, 0.998)):
            w = torch.randn(n, generator=g)
            if n == 9:
                w = special.clone()
            o = (torch.randn(n, generator=g) * 0.01).to(device, torch.bfloat16)
            if n == 9 and folded and decay == 1.0:
                o.zero_()  # the special values themselves reach the mirror
            w = w.to(device)
            ref_w, ref_m = w.clone(), torch.empty(n, device=device, dtype=torch.bfloat16)
            mirror = torch.empty_like(ref_m)
            apply_(w, o, mirror, decay=decay, scale=-0.03, folded=folded)
            apply_reference(ref_w, o, ref_m, decay=decay, scale=-0.03, folded=folded)
            tol = 0 if exact else 2e-7
            torch.testing.assert_close(w, ref_w, rtol=tol, atol=tol * 1e-5, equal_nan=True)
            nan = w.isnan()  # NaN bit patterns differ between torch's CPU and CUDA casts
            assert torch.equal(mirror.isnan(), nan), (n, folded, decay)
            assert torch.equal(bits(mirror)[~nan], bits(w.bfloat16())[~nan]), (n, folded, decay)
    done.append("apply kernel")
    return done


def assert_ulp_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` equals ``b`` within a few fp32 ulps of the operands' scale (CUDA: the reference's lerp
    may round its intermediate differently, and where the result cancels, one ulp of the
    operands is a large part of it: 2-3e-6 relative seen on an H200, 2026-12-04)."""
    torch.testing.assert_close(a, b, rtol=1e-6, atol=2**-21 * b.abs().max().item())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _make(device, shapes, backend, cls, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device)) for s in shapes]
    ps += [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device)) for s in ADAMW]
    nm = len(shapes)
    groups = [
        {"params": ps[:nm], "use_muon": True},
        {"params": ps[nm:], "use_muon": False, "weight_decay": 0.05},
    ]
    opt = cls(groups, lr=0.02, adjust_lr="rms", adamw_lr=1e-2, backend=backend, **kw)
    if isinstance(opt, MasterMuon):
        opt.small_numel = 100
    return ps, opt


def _grads(ps, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in ps]


def feed(opt, ps, qs, gs, bf16: bool) -> None:
    """Gradients ``gs`` to MasterMuon ``opt`` (its parameters ``ps``: as ``.grad``, or with
    ``bf16`` as one micro-batch's bf16 gradient through ``set_grad_source``) and, in fp32, to the
    reference's parameters ``qs``."""
    if bf16:
        gs = [g.bfloat16() for g in gs]
        src = {id(p): g for p, g in zip(ps, gs, strict=True)}
        opt.set_grad_source(lambda p: src[id(p)])
    else:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
    for q, g in zip(qs, gs, strict=True):
        q.grad = g.float()


def check_optimizer(device: str, shapes, steps: int, configs) -> list[str]:
    """MasterMuon (Triton path) against clip_grad_norm_ + Muon.step + copy, per step from the
    same masters (so each step's update is compared on its own)."""
    done = []
    for cfg in configs:
        kw = {k: cfg[k] for k in ("nesterov", "weight_decay", "ns_method") if k in cfg}
        backend = cfg.get("backend", "triton")
        ps, opt = _make(device, shapes, backend, MasterMuon, **kw)
        qs, ref = _make(device, shapes, backend, Muon, **kw)
        mirrors = {id(p): torch.zeros(p.shape, dtype=torch.bfloat16, device=device) for p in ps}
        opt.set_mirrors(mirrors)
        nm, same, total = len(shapes), 0, 0
        for step in range(cfg.get("steps", steps)):
            feed(opt, ps, qs, _grads(ps, step), cfg.get("bf16_grads", False))
            with torch.no_grad():
                for p, q in zip(ps, qs, strict=True):
                    q.copy_(p)
            before = [p.detach().clone() for p in ps]
            max_norm = cfg["max_norm"][step % len(cfg["max_norm"])]
            norm = opt.clip_norm_(max_norm)
            want = torch.nn.utils.clip_grad_norm_(qs, max_norm if max_norm > 0 else float("inf"))
            torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
            opt.step()
            ref.step()
            for i, (p, q, p0) in enumerate(zip(ps, qs, before, strict=True)):
                if i >= nm:  # AdamW side: flat_adamw_ / fused AdamW against torch's AdamW
                    # flat_adamw_ under the interpreter rounds to bf16 toward zero: one ulp
                    ulp = 2**-7 if device == "cpu" else 0
                    torch.testing.assert_close(
                        mirrors[id(p)], p.detach().bfloat16(), rtol=ulp, atol=0
                    )
                    torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
                    continue
                assert torch.equal(mirrors[id(p)], p.detach().bfloat16()), (cfg, step, i)
                m, mq = opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"]
                if device == "cpu":
                    assert torch.equal(m, mq), (cfg, step, i)
                else:
                    assert_ulp_close(m, mq)
                r = rel(p.detach() - p0, q.detach() - p0)
                assert r < (0.03 if device == "cpu" else 0.06), (cfg, step, i, r)
                same += torch.equal(p, q)
                total += 1
        if device == "cpu":  # see the module docstring: bitwise but where a norm ulp flips NS
            assert same >= 0.75 * total, (cfg, same, total)
        done.append(f"optimizer {cfg['name']}: {same}/{total} matrix-steps bitwise")
    return done


def check_resume(device: str, shapes) -> list[str]:
    """A checkpoint of either optimizer resumes the other: same next step."""
    done = []
    for first, second in ((Muon, MasterMuon), (MasterMuon, Muon)):
        # both on backend="triton" (MasterMuon's fused kernels, and the Gram form's Triton
        # products in both), so the two run the same NS
        ps, a = _make(device, shapes, "triton", first, ns_method="gram")
        for step in range(1):  # a momentum buffer and a step count to carry over
            for p, g in zip(ps, _grads(ps, step), strict=True):
                p.grad = g
            a.step()
        qs, b = _make(device, shapes, "triton", second, 1, ns_method="gram")
        with torch.no_grad():
            for p, q in zip(ps, qs, strict=True):
                q.copy_(p)
        b.load_state_dict(copy.deepcopy(a.state_dict()))
        for p, q, g in zip(ps, qs, _grads(ps, 1), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
        for i, (p, q) in enumerate(zip(ps, qs, strict=True)):
            if i < len(shapes):
                mb, ma = b.state[q]["momentum_buffer"], a.state[p]["momentum_buffer"]
                if device == "cpu":
                    assert torch.equal(mb, ma), (first.__name__, i)
                else:
                    assert_ulp_close(mb, ma)
                assert rel(q.detach(), p.detach()) < 1e-3
            else:
                assert float(b.state[q]["step"]) == float(a.state[p]["step"]) == 2.0
                torch.testing.assert_close(q, p, rtol=2e-6, atol=1e-7)
        done.append(f"resume {first.__name__} -> {second.__name__}")
    return done


# backend="triton" (the reference Muon too) also puts the Gram form's symmetric products on
# Triton's kernels; "standard NS" takes Triton's standard iteration, as a big square stack does
# on CUDA.
CONFIGS = [
    dict(name="nesterov clip", nesterov=True, weight_decay=0.1, max_norm=[1.0, 1e9, 2.0],
         ns_method="gram"),
    dict(name="plain no-decay", nesterov=False, weight_decay=0.0, max_norm=[0.0],
         ns_method="gram", steps=2),
    dict(name="bf16 grads", nesterov=True, weight_decay=0.1, max_norm=[1.0], bf16_grads=True,
         ns_method="gram", steps=2),
    dict(name="standard NS", nesterov=True, weight_decay=0.1, max_norm=[1.0],
         ns_method="standard", steps=1),
]  # fmt: skip


def main(device: str, big: bool) -> None:
    out = check_kernels(device)
    out += check_optimizer(device, SMALL, 3, CONFIGS)
    out += check_resume(device, SMALL)
    if big:  # real shapes (GPU): auto backend, as the trainer runs it
        cfgs = [dict(c, backend="auto", ns_method="auto") for c in CONFIGS[:3]]
        out += check_optimizer(device, BIG, 3, cfgs)
        out += check_resume(device, BIG)
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1], "big" in sys.argv[2:])


def dist_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 over ``world`` gloo ranks: MasterMuon (clip_norm_ on DTensor gradients, Muon's
    gathered step for the sharded matrices) against clip_grad_norm_ + Muon; writes out{rank}.json
    with the largest difference and the error set_mirrors raises."""
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    final, opts = {}, {}
    for cls in (Muon, MasterMuon):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 21), torch.nn.Tanh(), torch.nn.Linear(21, 5)
        )
        fully_shard(model, mesh=mesh)
        opt = opts[cls] = cls(model.parameters(), lr=0.02, weight_decay=0.1, adjust_lr="rms")
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 12, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            if cls is MasterMuon:
                opt.clip_norm_(0.05)
            else:
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.05)
            opt.step()
        final[cls] = [p.full_tensor() for p in model.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(*final.values(), strict=True))
    scale = max(a.abs().max().item() for a in final[Muon])
    master = opts[MasterMuon]
    try:
        master.set_mirrors(
            {id(p): torch.empty(1) for g in master.param_groups for p in g["params"]}
        )
        mirror_err = ""
    except NotImplementedError as e:
        mirror_err = str(e)
    with open(f"{out}/out{rank}.json", "w") as f:
        json.dump({"diff": diff, "scale": scale, "mirror_err": mirror_err}, f)
    dist.barrier()
    dist.destroy_process_group()
