"""Newton–Schulz orthogonalisation: coefficient schedules, torch backend, backend dispatch.

The quintic iteration maps ``X`` (singular values in (0, 1] after Frobenius scaling) towards the
orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ``::

    A = X Xᵀ ;  B = b A + c A² ;  X = a X + B X

Everything runs in bf16 with fp32 accumulation inside the matmuls, on the wide orientation
(``m <= n``; tall inputs go through the transpose), so the Gram matrix is the small ``m × m`` one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "COEFFICIENT_SCHEDULES",
    "NSSchedule",
    "newton_schulz",
    "newton_schulz_reference",
    "resolve_schedule",
]

Coefficients = tuple[float, float, float]
Backend = Literal["auto", "torch", "triton"]


@dataclass(kw_only=True, slots=True, frozen=True)
class NSSchedule:
    """A coefficient schedule: per-iteration ``(a, b, c)``; the last entry repeats.

    ``norm_scale`` multiplies the Frobenius norm before division (Polar Express uses 1.01 so
    that bf16 rounding cannot push a singular value above 1).
    """

    name: str
    coefficients: tuple[Coefficients, ...]
    norm_scale: float = 1.0

    def for_steps(self, steps: int) -> tuple[Coefficients, ...]:
        if steps < 1:
            raise ValueError(f"ns steps must be >= 1, got {steps}")
        cs = self.coefficients
        return cs[:steps] + (cs[-1],) * max(0, steps - len(cs))


def _polar_express() -> NSSchedule:
    # Amsel, Persson, Musco, Gower (2025), "The Polar Express", degree-5 schedule, with the
    # paper's safety factor 1.01 applied to every polynomial but the last.
    raw = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    )
    safe = (*tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in raw[:-1]), raw[-1])
    return NSSchedule(name="polar_express", coefficients=safe, norm_scale=1.01)


COEFFICIENT_SCHEDULES: dict[str, NSSchedule] = {
    # Keller Jordan's Muon: one quintic, repeated (not convergent: singular values land in
    # roughly [0.7, 1.2], which is what Muon wants and what makes 5 steps enough).
    "jordan": NSSchedule(name="jordan", coefficients=((3.4445, -4.7750, 2.0315),)),
    "polar_express": _polar_express(),
}


def resolve_schedule(coefficients: str | NSSchedule | Sequence[Coefficients]) -> NSSchedule:
    """Name (``"jordan"``, ``"polar_express"``), an :class:`NSSchedule`, or a list of triples."""
    if isinstance(coefficients, NSSchedule):
        return coefficients
    if isinstance(coefficients, str):
        try:
            return COEFFICIENT_SCHEDULES[coefficients]
        except KeyError:
            known = ", ".join(sorted(COEFFICIENT_SCHEDULES))
            raise ValueError(
                f"unknown Newton-Schulz schedule {coefficients!r}; known: {known}"
            ) from None
    triples = tuple(tuple(float(v) for v in t) for t in coefficients)
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError("coefficients must be a non-empty sequence of (a, b, c) triples")
    return NSSchedule(name="custom", coefficients=triples)  # type: ignore[arg-type]


def _prepare(G: torch.Tensor, norm_scale: float, eps: float) -> tuple[torch.Tensor, bool]:
    """bf16 cast, wide orientation (contiguous), Frobenius scaling.  G [..., m, n]."""
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got {G.shape}")
    transposed = G.size(-2) > G.size(-1)
    X = G.mT if transposed else G
    X = X.to(dtype=torch.bfloat16, memory_format=torch.contiguous_format)
    norm = X.norm(dim=(-2, -1), keepdim=True)  # [..., 1, 1]
    X = X / (norm * norm_scale + eps)
    return X, transposed


def _ns_torch(X: torch.Tensor, coeffs: Sequence[Coefficients], scale: float = 1.0) -> torch.Tensor:
    """Torch backend on a prepared stack X [B, m, n] (m <= n): 3 fused BLAS calls per step.

    The last step multiplies by ``scale`` inside the GEMM epilogue (free). A single matrix goes
    through the 2-D ``mm``/``addmm`` calls: batched ``baddbmm`` costs more host time per call,
    which dominates below ~1k×1k.
    """
    single = X.size(0) == 1
    Y = X[0] if single else X
    mm, addmm = (torch.mm, torch.addmm) if single else (torch.bmm, torch.baddbmm)
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        s = scale if i == last else 1.0
        A = mm(Y, Y.mT)  # [B, m, m]
        B = addmm(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        Y = addmm(Y, B, Y, beta=a * s, alpha=s)  # s·(a·X + B·X)
    return Y.unsqueeze(0) if single else Y


# Below this much work per Gram (B·m²·n) the Triton kernels lose to cuBLAS: too few tiles to
# fill the GPU and the autotuned launch costs more host time than the GPU work.
_TRITON_MIN_WORK = 1 << 34


def _ns_stack(
    X: torch.Tensor, coeffs: Sequence[Coefficients], backend: Backend, scale: float = 1.0
) -> torch.Tensor:
    """NS on a prepared stack X [B, m, n] (bf16, contiguous, m <= n, scaled; may be reused).

    Returns ``scale · NS(X)``. ``"auto"`` takes Triton on CUDA for stacks with enough work.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    nb, m, n = X.shape
    use_triton = backend == "triton" or (
        backend == "auto" and X.is_cuda and nb * m * m * n >= _TRITON_MIN_WORK and _triton_usable(X)
    )
    if not use_triton:
        return _ns_torch(X, coeffs, scale)
    if not _triton_usable(X):
        raise RuntimeError(
            "backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 for CPU "
            "tests); use backend='torch' here"
        )
    from ._triton_ns import ns_triton

    return ns_triton(X, coeffs, scale=scale)


def _triton_usable(X: torch.Tensor) -> bool:
    if X.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return False


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    *,
    coefficients: str | NSSchedule | Sequence[Coefficients] = "jordan",
    backend: Backend = "auto",
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate orthogonal polar factor of ``G`` (``[m, n]`` or a stack ``[..., m, n]``).

    Returns bf16 of the same shape. Each matrix of a stack is scaled by its own Frobenius norm.
    ``backend="auto"`` picks Triton on CUDA (symmetric Gram kernels: half the FLOPs of the two
    ``m × m`` products) when the stack holds enough work (``B·m²·n >= 2**34``), torch elsewhere; ``"triton"`` also runs on CPU under
    ``TRITON_INTERPRET=1`` (tests only: slow).
    """
    schedule = resolve_schedule(coefficients)
    coeffs = schedule.for_steps(steps)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton" and not _triton_usable(G):
        raise RuntimeError(
            "backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 for CPU "
            "tests); use backend='torch' here"
        )
    X, transposed = _prepare(G, schedule.norm_scale, eps)
    batch_shape = X.shape[:-2]
    out = _ns_stack(X.reshape(-1, X.size(-2), X.size(-1)), coeffs, backend)  # [B, m, n]
    out = out.reshape(*batch_shape, out.size(-2), out.size(-1))
    return out.mT if transposed else out


def newton_schulz_reference(
    G: torch.Tensor,
    steps: int = 5,
    *,
    coefficients: str | NSSchedule | Sequence[Coefficients] = "jordan",
    eps: float = 1e-7,
) -> torch.Tensor:
    """The published iteration written plainly (one matrix or a stack): the parity baseline."""
    schedule = resolve_schedule(coefficients)
    X = G.bfloat16()
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * schedule.norm_scale + eps)
    for a, b, c in schedule.for_steps(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X
