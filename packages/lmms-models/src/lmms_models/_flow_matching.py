"""Flow matching on stochastic interpolants: paths, targets, timestep sampling, CFG dropout, ODE.

One convention inside (SiT's): ``t = 0`` is pure noise ``x0 ~ N(0, I)``, ``t = 1`` is data ``x1``
and the interpolant is ``x_t = alpha_t x1 + sigma_t x0``. Its velocity is
``u_t = alpha'_t x1 + sigma'_t x0``. Paths:

* ``linear`` (rectified flow, SD3/Wan): ``alpha = t``, ``sigma = 1 - t`` (``u = x1 - x0``).
* ``gvp`` (generalised variance preserving): ``alpha = sin(pi t / 2)``, ``sigma = cos(pi t / 2)``.
* ``vp`` (the VP-SDE's marginals, ``beta`` from ``sigma_min = 0.1`` to ``sigma_max = 20``):
  ``log alpha = -(1-t)^2 (smax - smin) / 4 - (1-t) smin / 2``, ``sigma = sqrt(1 - alpha^2)``.

Prediction targets (``prediction``): ``velocity`` regresses ``u_t``; ``noise`` regresses ``x0``;
``score`` regresses ``-x0 / sigma_t`` through ``|s sigma_t + x0|^2``. The last two may be weighted
(``loss_weight``: ``velocity`` = ``(D_t / sigma_t)^2``, ``likelihood`` = ``D_t / sigma_t^2``, with
the diffusion coefficient ``D_t = (alpha'/alpha) sigma^2 - sigma sigma'``).

Timesteps are drawn as a *noise level* ``u`` in (0, 1) (``uniform`` or ``logit_normal``:
``u = sigmoid(m + s n)``), shifted like Wan/SD3 (``u' = k u / (1 + (k - 1) u)``, ``k = shift``: more
steps at high noise for large latents), then ``t = t0 + (t1 - t0)(1 - u')``.

``convention`` states what the network sees: ``sit`` (input time ``t``, output in the target's own
sign) or ``rectified_flow`` (diffusers/Wan: input timestep ``1000 (1 - t)``, i.e. the noise level
in [0, 1000], and the velocity output is ``x0 - x1 = -u_t``).

Noise, timesteps and the CFG drop decision are drawn *per sample* from a generator seeded by the
sample (``noise_seed``, which the data pipeline derives from the record's position): the draws are
independent of the batch layout (micro-batching, data-parallel ranks, SP) and a resumed run
replays them bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FlowMatchingConfig",
    "flow_matching_loss",
    "interpolant",
    "ode_sample",
    "path_coefficients",
    "sample_noise_level",
    "shift_noise_level",
    "velocity_from_output",
]

PATHS = ("linear", "gvp", "vp")
PREDICTIONS = ("velocity", "score", "noise")
LOSS_WEIGHTS = ("none", "velocity", "likelihood")
TIME_SAMPLINGS = ("uniform", "logit_normal")
CONVENTIONS = ("sit", "rectified_flow")
VP_SIGMA_MIN, VP_SIGMA_MAX = 0.1, 20.0


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"flow matching: {name}={value!r}; choose one of {', '.join(allowed)}")


@dataclass(kw_only=True, slots=True)
class FlowMatchingConfig:
    """The objective's knobs (YAML: ``objective_config``); defaults are rectified flow."""

    path: str = "linear"
    prediction: str = "velocity"
    loss_weight: str = "none"  # score / noise predictions only
    time_sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0  # Wan2.1 trains with 5.0 at 480p/720p
    train_eps: float | None = None  # None: 0 for linear/gvp velocity, 1e-5 otherwise (SiT)
    cfg_dropout: float = 0.0  # probability that a sample's condition is replaced by the null one
    convention: str = "sit"
    timestep_scale: float = 1000.0  # rectified_flow only: network timestep = scale * noise level
    time_buckets: int = 4  # loss per timestep bucket in the metrics

    def __post_init__(self) -> None:
        _check("path", self.path, PATHS)
        _check("prediction", self.prediction, PREDICTIONS)
        _check("loss_weight", self.loss_weight, LOSS_WEIGHTS)
        _check("time_sampling", self.time_sampling, TIME_SAMPLINGS)
        _check("convention", self.convention, CONVENTIONS)
        if self.convention == "rectified_flow" and (
            self.path != "linear" or self.prediction != "velocity"
        ):
            raise ValueError(
                "flow matching: convention=rectified_flow is the linear path with velocity "
                "prediction (the diffusers/Wan parameterisation); use convention=sit for others"
            )
        if self.loss_weight != "none" and self.prediction == "velocity":
            raise ValueError("flow matching: loss_weight applies to score/noise predictions only")
        if not 0.0 <= self.cfg_dropout < 1.0:
            raise ValueError(f"flow matching: cfg_dropout={self.cfg_dropout} not in [0, 1)")
        if self.shift <= 0 or self.logit_std <= 0:
            raise ValueError("flow matching: shift and logit_std must be positive")
        if self.time_buckets < 1:
            raise ValueError("flow matching: time_buckets must be >= 1")

    def time_range(self) -> tuple[float, float]:
        """``(t0, t1)``: SiT keeps away from the ends where a coefficient is singular."""
        eps = self.train_eps
        if eps is None:
            smooth = self.path in ("linear", "gvp") and self.prediction == "velocity"
            eps = 0.0 if smooth else 1e-5
        t0 = eps if self.prediction in ("score", "noise") else 0.0
        t1 = 1.0 - eps if (self.path == "vp" or self.prediction != "velocity") else 1.0
        return t0, t1


# ------------------------------------------------------------------------------ paths
def path_coefficients(path: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(alpha, sigma, d_alpha, d_sigma)`` of ``path`` at ``t`` (any shape, fp32/fp64)."""
    _check("path", path, PATHS)
    if path == "linear":
        return t, 1 - t, torch.ones_like(t), -torch.ones_like(t)
    if path == "gvp":
        a = 0.5 * math.pi
        return torch.sin(a * t), torch.cos(a * t), a * torch.cos(a * t), -a * torch.sin(a * t)
    span = VP_SIGMA_MAX - VP_SIGMA_MIN
    s = 1 - t
    log_alpha = -0.25 * s**2 * span - 0.5 * s * VP_SIGMA_MIN
    d_log_alpha = 0.5 * s * span + 0.5 * VP_SIGMA_MIN
    alpha = torch.exp(log_alpha)
    sigma = torch.sqrt(-torch.expm1(2 * log_alpha))  # sqrt(1 - alpha^2), exact near alpha = 1
    return alpha, sigma, alpha * d_log_alpha, -(alpha**2) * d_log_alpha / sigma


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(v.shape[0], *([1] * (like.ndim - 1)))  # [B] -> [B, 1, ...]


def interpolant(
    path: str, t: torch.Tensor, x1: torch.Tensor, x0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, u_t)`` for data ``x1 [B, ...]``, noise ``x0 [B, ...]`` and ``t [B]``."""
    alpha, sigma, d_alpha, d_sigma = (_bcast(c, x1) for c in path_coefficients(path, t))
    return alpha * x1 + sigma * x0, d_alpha * x1 + d_sigma * x0


def diffusion_coefficient(path: str, t: torch.Tensor) -> torch.Tensor:
    """``D_t = (alpha'/alpha) sigma^2 - sigma sigma'``: the score's factor in the velocity."""
    alpha, sigma, d_alpha, d_sigma = path_coefficients(path, t)
    return d_alpha / alpha * sigma**2 - sigma * d_sigma


# ------------------------------------------------------------------------------ timesteps
def shift_noise_level(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan/SD3 timestep shift of a noise level ``u`` in [0, 1]: ``k u / (1 + (k - 1) u)``."""
    return u if shift == 1.0 else shift * u / (1 + (shift - 1) * u)


def sample_noise_level(cfg: FlowMatchingConfig, gen: torch.Generator, device: Any) -> torch.Tensor:
    """One noise level ``u`` in (0, 1) (shape ``[1]``, fp32) drawn from ``gen``."""
    if cfg.time_sampling == "uniform":
        u = torch.rand(1, generator=gen, device=device)
    else:
        n = torch.randn(1, generator=gen, device=device)
        u = torch.sigmoid(cfg.logit_mean + cfg.logit_std * n)
    return shift_noise_level(u, cfg.shift)


def to_time(cfg: FlowMatchingConfig, u: torch.Tensor) -> torch.Tensor:
    """The interpolant time ``t`` for noise levels ``u`` (``t = 1``: data)."""
    t0, t1 = cfg.time_range()
    return t0 + (t1 - t0) * (1 - u)


def model_time(cfg: FlowMatchingConfig, t: torch.Tensor) -> torch.Tensor:
    """What the network receives as its timestep for interpolant times ``t [B]``."""
    return t if cfg.convention == "sit" else cfg.timestep_scale * (1 - t)


@dataclass(kw_only=True, slots=True)
class Draws:
    """Per-sample random draws of one batch: noise ``[B, ...]``, times ``t [B]``, ``drop [B]``."""

    noise: torch.Tensor
    t: torch.Tensor
    drop: torch.Tensor


def draw(
    cfg: FlowMatchingConfig, seeds: torch.Tensor, shape: tuple[int, ...], device: Any
) -> Draws:
    """Noise, time and CFG drop for each sample, from a generator seeded with its ``seeds[i]``:
    the time first, then the drop decision, then the noise (fp32, shape ``[B, *shape]``).

    Drawn on the CPU whatever ``device``, so a GPU run draws what a CPU run draws (a CUDA
    generator gives other numbers for the same seed), then copied from pinned memory without
    the host waiting for the device."""
    noise, ts, drops = [], [], []
    gen = torch.Generator()
    for seed in seeds.tolist():
        gen.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
        ts.append(to_time(cfg, sample_noise_level(cfg, gen, "cpu")))
        drops.append(torch.rand(1, generator=gen) < cfg.cfg_dropout)
        noise.append(torch.randn(shape, generator=gen))
    out = [torch.stack(noise), torch.cat(ts), torch.cat(drops)]
    if torch.device(device).type != "cpu":
        pin = torch.cuda.is_available()
        out = [(x.pin_memory() if pin else x).to(device, non_blocking=pin) for x in out]
    return Draws(noise=out[0], t=out[1], drop=out[2])


# ------------------------------------------------------------------------------ loss
def flow_matching_loss(
    cfg: FlowMatchingConfig,
    output: torch.Tensor,  # [B, ...] the network's prediction at x_t
    x1: torch.Tensor,  # [B, ...] data (latents)
    x0: torch.Tensor,  # [B, ...] noise
    t: torch.Tensor,  # [B] interpolant times
) -> torch.Tensor:
    """Per-sample loss ``[B]`` (fp32): the squared error averaged over each sample's elements."""
    output, x1, x0, t = output.float(), x1.float(), x0.float(), t.float()
    if cfg.prediction == "velocity":
        _, u = interpolant(cfg.path, t, x1, x0)
        target = -u if cfg.convention == "rectified_flow" else u
        err = output - target
        weight = None
    else:
        sigma = _bcast(path_coefficients(cfg.path, t)[1], x1)
        err = output - x0 if cfg.prediction == "noise" else output * sigma + x0
        weight = _loss_weight(cfg, t)
    per = err.pow(2).flatten(1).mean(1)  # [B]
    return per if weight is None else per * weight


def _loss_weight(cfg: FlowMatchingConfig, t: torch.Tensor) -> torch.Tensor | None:
    if cfg.loss_weight == "none":
        return None
    d = diffusion_coefficient(cfg.path, t)
    sigma = path_coefficients(cfg.path, t)[1]
    return (d / sigma) ** 2 if cfg.loss_weight == "velocity" else d / sigma**2


def bucket_sums(
    cfg: FlowMatchingConfig, per_sample: torch.Tensor, t: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Loss sums and counts per noise-level bucket (``loss_t/<lo>-<hi>`` and ``count_t/...``),
    as device tensors: the trainer divides the global sums."""
    k = cfg.time_buckets
    idx = ((1 - t.detach().float()) * k).long().clamp(0, k - 1)  # noise level bucket
    sums = torch.zeros(k, device=t.device).index_add_(0, idx, per_sample.detach().float())
    counts = torch.zeros(k, device=t.device).index_add_(0, idx, torch.ones_like(sums[idx]))
    out = {}
    for i in range(k):
        name = f"{i / k:.2f}-{(i + 1) / k:.2f}"
        out[f"loss_t/{name}"], out[f"count_t/{name}"] = sums[i], counts[i]
    return out


# ------------------------------------------------------------------------------ sampling
def velocity_from_output(
    cfg: FlowMatchingConfig, output: torch.Tensor, x: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The interpolant velocity ``u_t`` (SiT sign) implied by the network's ``output`` at ``x``."""
    if cfg.prediction == "velocity":
        return -output if cfg.convention == "rectified_flow" else output
    alpha, sigma, d_alpha, _ = (_bcast(c, x) for c in path_coefficients(cfg.path, t))
    d = _bcast(diffusion_coefficient(cfg.path, t), x)
    drift = d_alpha / alpha * x
    if cfg.prediction == "score":
        return drift + d * output
    return drift - d / sigma * output


@torch.no_grad()
def ode_sample(
    cfg: FlowMatchingConfig,
    net: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
    noise: torch.Tensor,  # [B, ...]
    *,
    steps: int = 50,
    method: str = "euler",
    guidance: float = 1.0,
) -> torch.Tensor:
    """Integrate the probability-flow ODE from noise (``t0``) to data (``t1``).

    ``net(x, model_time, uncond)`` returns the network output (``uncond``: the null condition).
    ``guidance`` > 1 mixes the conditional and unconditional velocities (CFG). ``method``:
    ``euler`` (one evaluation per step) or ``heun`` (two; the last step is plain Euler).
    Time steps follow the training shift (uniform in the shifted noise level).
    """
    if method not in ("euler", "heun"):
        raise ValueError(f"ode_sample: method={method!r}; choose euler or heun")
    levels = shift_noise_level(torch.linspace(1.0, 0.0, steps + 1), cfg.shift)
    times = to_time(cfg, levels).tolist()

    def vel(x: torch.Tensor, t: float) -> torch.Tensor:
        tt = torch.full((x.shape[0],), t, device=x.device, dtype=torch.float32)
        v = velocity_from_output(cfg, net(x, model_time(cfg, tt), False).float(), x, tt)
        if guidance != 1.0:
            vu = velocity_from_output(cfg, net(x, model_time(cfg, tt), True).float(), x, tt)
            v = vu + guidance * (v - vu)
        return v

    x = noise.float()
    for i in range(steps):
        t, t_next = times[i], times[i + 1]
        v = vel(x, t)
        x_euler = x + (t_next - t) * v
        if method == "heun" and i < steps - 1:
            x = x + (t_next - t) * 0.5 * (v + vel(x_euler, t_next))
        else:
            x = x_euler
    return x
