"""MasterAdamW's Triton path against its torch path; run under TRITON_INTERPRET=1 on CPU (CI) or
on a GPU: `python master_adamw_checks.py cpu|cuda`. Prints one line per check."""

import copy
import sys

import torch

from lmms_optim import MasterAdamW

SHAPES = [(37, 53), (129,), (3, 5, 7), (1,)]


def _make(device: str, backend: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]
    groups = [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3},
    ]
    opt = MasterAdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, backend=backend)
    opt.small_numel = 200  # the 37x53 matrix through the kernel, the rest through foreach
    mirrors = {id(p): torch.empty(p.shape, dtype=torch.bfloat16, device=device) for p in params}
    opt.set_mirrors(mirrors)
    return params, opt, mirrors


def _grads(step: int, device: str):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def main(device: str) -> None:
    runs = {}
    for backend in ("torch", "triton"):
        params, opt, mirrors = _make(device, backend)
        for step in range(3):
            for p, g in zip(params, _grads(step, device), strict=True):
                p.grad = g.clone()
            opt.clip_scale = torch.tensor(0.5 if step != 1 else 1.0, device=device)
            opt.step()
        runs[backend] = (params, opt, mirrors)
    (pt, ot, mt), (pk, ok, mk) = runs["torch"], runs["triton"]
    for a, b in zip(pt, pk, strict=True):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)
        # the interpreter rounds fp32 -> bf16 towards zero (the GPU to nearest even): one ulp
        ulp = 0 if device == "cuda" else 2**-7
        torch.testing.assert_close(mk[id(b)], b.detach().bfloat16(), rtol=ulp, atol=0)
        torch.testing.assert_close(mt[id(a)], a.detach().bfloat16(), rtol=0, atol=0)
        sa, sb = ot.state[a], ok.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 3.0
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=2e-6, atol=1e-8)
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=2e-6, atol=1e-10)
    print(f"master_adamw triton == torch over 3 steps on {device}")
    # resume: the Triton optimizer loads the torch one's state and both take a 4th step alike
    params, opt, _ = _make(device, "triton", seed=1)
    with torch.no_grad():
        for p, q in zip(params, pt, strict=True):
            p.copy_(q)
    opt.load_state_dict(
        copy.deepcopy(ot.state_dict())
    )  # load_state_dict shares same-device tensors
    for p, q, g in zip(params, pt, _grads(3, device), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    ot.step()
    for p, q in zip(params, pt, strict=True):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
    assert float(opt.state[params[0]]["step"]) == 4.0
    print(f"master_adamw resumes torch state on {device}")
    # bf16 gradients through set_grad_source (what MasterWeights' deferred cast hands over): the
    # kernel reads them as they are, the torch path casts them; the norm accumulates in fp32
    ran = {}
    for backend in ("torch", "triton"):
        params, opt, mirrors = _make(device, backend, seed=2)
        bf16 = {id(p): g.bfloat16() for p, g in zip(params, _grads(7, device), strict=True)}
        opt.set_grad_source(lambda p, bf16=bf16: p.grad if p.grad is not None else bf16[id(p)])
        norm = opt.clip_norm_(1.0)
        want = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in bf16.values()]))
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        opt.step()
        ran[backend] = params
    for a, b in zip(ran["torch"], ran["triton"], strict=True):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)
    print(f"master_adamw bf16 gradients on {device}")


if __name__ == "__main__":
    main(sys.argv[1])
