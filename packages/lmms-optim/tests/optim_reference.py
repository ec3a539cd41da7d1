"""From-scratch references of the published algorithms, independent of lmms_optim's code."""

from __future__ import annotations

import math

import torch

JORDAN = [(3.4445, -4.7750, 2.0315)]


def ns5(G: torch.Tensor, steps: int = 5, coeffs=JORDAN, norm_scale: float = 1.0) -> torch.Tensor:
    """Keller Jordan's zeropower_via_newtonschulz5 for one matrix, with a coefficient list."""
    assert G.ndim == 2
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() * norm_scale + 1e-7)
    for i in range(steps):
        a, b, c = coeffs[min(i, len(coeffs) - 1)]
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


def scale(mode, shape) -> float:
    fo, fi = shape[0], math.prod(shape[1:])
    return {
        None: 1.0,
        "original": max(1.0, fo / fi) ** 0.5,
        "rms": 0.2 * max(fo, fi) ** 0.5,
        "spectral": (fo / fi) ** 0.5,
    }[mode]


def muon_step(p, g, buf, *, lr, momentum, nesterov, wd, adjust_lr, steps=5):
    """One published Muon step (EMA momentum form) on plain tensors, in place on p and buf."""
    buf.lerp_(g, 1 - momentum)
    u = g.lerp(buf, momentum) if nesterov else buf
    o = ns5(u.reshape(len(u), -1), steps).view(p.shape)
    p.mul_(1 - lr * wd)
    p.add_(o.float(), alpha=-lr * scale(adjust_lr, p.shape))


def ns_exact(G: torch.Tensor, steps: int = 5, coeffs=JORDAN, norm_scale: float = 1.0):
    """The same iteration in float64: what both bf16 implementations approximate."""
    X = G.double()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * norm_scale + 1e-7)
    for i in range(steps):
        a, b, c = coeffs[min(i, len(coeffs) - 1)]
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(-2) > G.size(-1) else X


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def assert_ns_close(out, G, steps=5, coeffs=JORDAN, norm_scale=1.0, near=0.06, factor=1.25):
    """bf16 tolerance for NS: near the published bf16 iteration (``near``), and no further from
    the exact (float64) iteration than ``factor`` times that published bf16 iteration is (plus a
    small slack)."""
    exact = ns_exact(G, steps, coeffs, norm_scale)
    published = torch.stack(
        [ns5(g, steps, coeffs, norm_scale) for g in G.reshape(-1, *G.shape[-2:])]
    )
    published = published.view(G.shape)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    assert rel(out, published) < near, rel(out, published)
    assert rel(out, exact) <= factor * rel(published, exact) + 5e-3, (
        rel(out, exact),
        rel(published, exact),
    )
