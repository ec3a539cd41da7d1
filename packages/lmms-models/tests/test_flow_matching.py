"""Flow matching formulas against from-scratch references (float64, per sample, autograd
derivatives), the draws' reproducibility, and the ODE sampler on a problem with a known answer."""

from __future__ import annotations

import math

import pytest
import torch

from lmms_models import _flow_matching as fm

PATH_CASES = ("linear", "gvp", "vp")


def _ref_alpha_sigma(path: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_t, sigma_t written from the papers' definitions (SiT, Table 1 / VP-SDE)."""
    if path == "linear":
        return t, 1.0 - t
    if path == "gvp":
        return torch.sin(math.pi * t / 2), torch.cos(math.pi * t / 2)
    # VP-SDE with beta(s) = smin + s (smax - smin): alpha = exp(-1/2 int_0^{1-t} beta)
    s = 1.0 - t
    integral = 0.1 * s + 0.5 * (20.0 - 0.1) * s**2
    alpha = torch.exp(-0.5 * integral)
    return alpha, torch.sqrt(1.0 - alpha**2)


def _ref_derivatives(path: str, t: float) -> tuple[float, float, float, float]:
    tt = torch.tensor(t, dtype=torch.float64, requires_grad=True)
    a, s = _ref_alpha_sigma(path, tt)
    (da,) = torch.autograd.grad(a, tt, retain_graph=True)
    (ds,) = torch.autograd.grad(s, tt)
    return float(a.detach()), float(s.detach()), float(da), float(ds)


@pytest.mark.parametrize("path", PATH_CASES)
def test_path_coefficients_match_definitions(path: str) -> None:
    ts = torch.tensor([0.02, 0.3, 0.5, 0.77, 0.98], dtype=torch.float64)
    got = fm.path_coefficients(path, ts)
    for i, t in enumerate(ts.tolist()):
        want = _ref_derivatives(path, t)
        for g, w in zip(got, want, strict=True):
            assert float(g[i]) == pytest.approx(w, rel=1e-10, abs=1e-12)


def _ref_loss(cfg: fm.FlowMatchingConfig, out, x1, x0, t) -> torch.Tensor:
    """Per-sample loss, one sample at a time in float64, from the definitions."""
    losses = []
    for i in range(x1.shape[0]):
        a, s, da, ds = _ref_derivatives(cfg.path, float(t[i]))
        o, d, n = out[i].double(), x1[i].double(), x0[i].double()
        if cfg.prediction == "velocity":
            target = da * d + ds * n
            if cfg.convention == "rectified_flow":
                target = n - d  # diffusers/Wan: noise minus data
            losses.append(((o - target) ** 2).mean())
            continue
        diff = da / a * s**2 - s * ds  # the score's coefficient in the velocity
        w = {"none": 1.0, "velocity": (diff / s) ** 2, "likelihood": diff / s**2}[cfg.loss_weight]
        err = o - n if cfg.prediction == "noise" else o * s + n  # score target: -noise / sigma
        losses.append(w * (err**2).mean())
    return torch.stack(losses)


LOSS_CASES = [
    dict(path="linear", prediction="velocity"),
    dict(path="linear", prediction="velocity", convention="rectified_flow"),
    dict(path="gvp", prediction="velocity"),
    dict(path="vp", prediction="velocity"),
    *[
        dict(path=p, prediction=pred, loss_weight=w)
        for p in PATH_CASES
        for pred in ("score", "noise")
        for w in ("none", "velocity", "likelihood")
    ],
]


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: "-".join(c.values()))
def test_loss_equals_reference(case: dict) -> None:
    cfg = fm.FlowMatchingConfig(**case)
    g = torch.Generator().manual_seed(0)
    x1, x0, out = (torch.randn(3, 4, 5, 6, generator=g) for _ in range(3))
    t0, t1 = cfg.time_range()
    t = torch.tensor([t0 + 0.1, 0.5, min(t1, 0.93)])
    got = fm.flow_matching_loss(cfg, out, x1, x0, t)
    want = _ref_loss(cfg, out, x1, x0, t)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-7)
    # the interpolant itself: x_t = alpha x1 + sigma x0
    xt, _ = fm.interpolant(cfg.path, t, x1, x0)
    a, s = _ref_alpha_sigma(cfg.path, t.double())
    torch.testing.assert_close(
        xt.double(), a[:, None, None, None] * x1 + s[:, None, None, None] * x0
    )


def test_rectified_flow_is_the_diffusers_parameterisation() -> None:
    """x_t = (1 - sigma) x + sigma noise, target noise - x, timestep 1000 sigma (Wan/SD3)."""
    cfg = fm.FlowMatchingConfig(convention="rectified_flow")
    x, n = torch.randn(2, 3), torch.randn(2, 3)
    sigma = torch.tensor([0.25, 0.9])
    t = fm.to_time(cfg, sigma)
    xt, _ = fm.interpolant("linear", t, x, n)
    torch.testing.assert_close(xt, (1 - sigma)[:, None] * x + sigma[:, None] * n)
    torch.testing.assert_close(fm.model_time(cfg, t), 1000 * sigma)
    assert torch.all(fm.flow_matching_loss(cfg, n - x, x, n, t) == 0)


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_timestep_sampling_reference(sampling: str, shift: float) -> None:
    cfg = fm.FlowMatchingConfig(time_sampling=sampling, shift=shift, logit_mean=0.3, logit_std=0.8)
    got, want = [], []
    for seed in range(200):
        got.append(float(fm.sample_noise_level(cfg, torch.Generator().manual_seed(seed), "cpu")))
        g = torch.Generator().manual_seed(seed)
        if sampling == "uniform":
            u = float(torch.rand(1, generator=g))
        else:
            u = 1 / (1 + math.exp(-(0.3 + 0.8 * float(torch.randn(1, generator=g)))))
        want.append(shift * u / (1 + (shift - 1) * u))  # Wan's shift of the noise level
    assert got == pytest.approx(want, rel=1e-6)
    # the distribution: with shift the median noise level moves up to k/(1+k) of 0.5's image
    levels = torch.tensor(
        [
            float(fm.sample_noise_level(cfg, torch.Generator().manual_seed(s), "cpu"))
            for s in range(4000)
        ]
    )
    med0 = 0.5 if sampling == "uniform" else 1 / (1 + math.exp(-0.3))
    assert float(levels.median()) == pytest.approx(
        shift * med0 / (1 + (shift - 1) * med0), abs=0.03
    )


def test_draws_are_per_sample_and_reproducible() -> None:
    cfg = fm.FlowMatchingConfig(cfg_dropout=0.25)
    seeds = torch.arange(400) * 7919 + 3
    a = fm.draw(cfg, seeds, (2, 3), "cpu")
    b = fm.draw(cfg, seeds[100:105], (2, 3), "cpu")  # a sub-batch: the same draws
    assert torch.equal(a.noise[100:105], b.noise) and torch.equal(a.t[100:105], b.t)
    assert torch.equal(a.drop[100:105], b.drop)
    assert 0.18 < float(a.drop.float().mean()) < 0.32  # CFG dropout rate
    assert not torch.equal(a.noise[0], a.noise[1])
    assert fm.draw(fm.FlowMatchingConfig(), seeds[:50], (1,), "cpu").drop.sum() == 0


@pytest.mark.parametrize(
    "case",
    [
        dict(path="linear", prediction="velocity"),
        dict(path="linear", prediction="velocity", convention="rectified_flow", shift=3.0),
        dict(path="gvp", prediction="velocity"),
        dict(path="linear", prediction="noise"),
        dict(path="gvp", prediction="score"),
        dict(path="vp", prediction="velocity"),
    ],
    ids=lambda c: "-".join(map(str, c.values())),
)
@pytest.mark.parametrize("method", ["euler", "heun"])
def test_ode_sampler_reaches_a_point_mass(case: dict, method: str) -> None:
    """Data = one point c: the exact network output is known in closed form for every target;
    the sampler must carry any noise to c (up to the interval's end and step error)."""
    cfg = fm.FlowMatchingConfig(**case)
    c = torch.tensor([[1.5, -2.0, 0.25]])

    def net(x: torch.Tensor, mt: torch.Tensor, uncond: bool) -> torch.Tensor:
        t = mt if cfg.convention == "sit" else 1 - mt / cfg.timestep_scale
        a, s, da, ds = (v[:, None].double() for v in fm.path_coefficients(cfg.path, t.double()))
        noise = (x.double() - a * c) / s  # x = a c + s noise
        if cfg.prediction == "velocity":
            u = da * c + ds * noise
            return (-u if cfg.convention == "rectified_flow" else u).float()
        return (noise if cfg.prediction == "noise" else -noise / s).float()

    x0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    out = fm.ode_sample(cfg, net, x0, steps=200, method=method)
    tol = 0.05 if cfg.path == "vp" else 1e-3  # vp stops at t1 = 1 - 1e-5 where sigma ~ 4e-3
    torch.testing.assert_close(out, c.expand(4, 3), atol=tol, rtol=0)


def test_guidance_mixes_velocities() -> None:
    cfg = fm.FlowMatchingConfig()
    calls = []

    def net(x, mt, uncond):
        calls.append(uncond)
        return torch.full_like(x, 0.0 if uncond else 1.0)

    out = fm.ode_sample(cfg, net, torch.zeros(1, 2), steps=4, guidance=3.0)
    torch.testing.assert_close(out, torch.full((1, 2), 3.0))  # v = 0 + 3 (1 - 0) over t in [0, 1]
    assert calls.count(True) == calls.count(False) == 4


def test_bucket_sums_and_bad_config() -> None:
    cfg = fm.FlowMatchingConfig(time_buckets=4)
    per = torch.tensor([1.0, 2.0, 3.0, 4.0])
    t = torch.tensor([0.95, 0.9, 0.1, 0.6])  # noise levels 0.05, 0.1, 0.9, 0.4
    b = fm.bucket_sums(cfg, per, t)
    assert float(b["loss_t/0.00-0.25"]) == 3.0 and float(b["count_t/0.00-0.25"]) == 2
    assert float(b["loss_t/0.75-1.00"]) == 3.0 and float(b["loss_t/0.25-0.50"]) == 4.0
    with pytest.raises(ValueError, match="choose one of"):
        fm.FlowMatchingConfig(path="cosine")
    with pytest.raises(ValueError, match="rectified_flow"):
        fm.FlowMatchingConfig(convention="rectified_flow", prediction="score")
