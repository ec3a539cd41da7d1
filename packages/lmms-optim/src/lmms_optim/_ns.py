"""Newton–Schulz orthogonalisation: coefficient schedules, torch backend, backend dispatch.

The quintic iteration maps ``X`` (singular values in (0, 1] after Frobenius scaling) towards the
orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ``::

    A = X Xᵀ ;  B = b A + c A² ;  X = a X + B X

Everything runs in bf16 with fp32 accumulation inside the matmuls, on the small Gram matrix
(``m × m`` with ``m = min(rows, cols)``).

Two algorithms compute the same polynomial (``method``):

- ``"standard"``: the iteration above (``4m²n + 2m³`` FLOPs per step). Tall stacks use the
  right-multiplication form ``A = XᵀX ; X = a X + X B`` (no transpose copy).
- ``"gram"``: every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``A_0 = X_0 X_0ᵀ``,
  so the loop runs on ``m × m`` matrices (``M = aI + bA + cA² ; Q ← M Q ; A ← M A M``) and
  ``X`` is formed only at a restart (every ``GRAM_RESTART`` steps, with a fresh Gram: this keeps
  the bf16 ``m × m`` recursion from drifting) and at the end. 5 steps cost ``8m²n + 28m³``
  FLOPs instead of ``20m²n + 10m³``: a win for ``n/m >= GRAM_MIN_ASPECT`` (``"auto"``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "COEFFICIENT_SCHEDULES",
    "GRAM_MIN_ASPECT",
    "NSSchedule",
    "newton_schulz",
    "newton_schulz_reference",
    "resolve_schedule",
]

Coefficients = tuple[float, float, float]
Backend = Literal["auto", "torch", "triton"]
Method = Literal["auto", "standard", "gram"]

# "auto" takes the Gram form when max(rows, cols) >= GRAM_MIN_ASPECT · min(rows, cols): the FLOP
# ratio standard/gram (20r + 10)/(8r + 28) is 1.28 at r = 2.5, 1.66 at r = 5.4 (2048×11008).
GRAM_MIN_ASPECT = 2.5
# Steps between restarts of the Gram form (X = Q X0 and a fresh Gram): bf16 with a restart after
# 3 steps is as accurate as the published bf16 iteration (benchmarks/optim/ns_accuracy.py); with
# no restart the bf16 m×m recursion loses the small singular directions (error ~1).
GRAM_RESTART = 3


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


def _prepare_stack(
    G: torch.Tensor, norm_scale: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """G [..., r, c] -> (bf16 stack [B, r, c] in G's own orientation, fp32 1/(norm·scale + eps) [B]).

    The same arithmetic as ``Muon``'s local step (so sharded and local Muon agree bit for bit).
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got {G.shape}")
    X = G.reshape(-1, G.size(-2), G.size(-1)).to(torch.bfloat16, copy=True)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float32)  # [B]
    return X.contiguous(), norm.mul_(norm_scale).add_(eps).reciprocal_()


def _ns_torch(X: torch.Tensor, coeffs: Sequence[Coefficients], scale: float = 1.0) -> torch.Tensor:
    """Torch backend on a prepared stack X [B, r, c]: 3 fused BLAS calls per step.

    Wide (``r <= c``): ``A = X Xᵀ``, ``X = aX + BX``; tall: ``A = XᵀX``, ``X = aX + XB`` (the
    same polynomial on the transposed problem, without a transpose copy). The last step
    multiplies by ``scale`` inside the GEMM epilogue (free). A single matrix goes through the
    2-D ``mm``/``addmm`` calls: batched ``baddbmm`` costs more host time per call, which
    dominates below ~1k×1k.
    """
    single = X.size(0) == 1
    tall = X.size(-2) > X.size(-1)
    Y = X[0] if single else X
    mm, addmm = (torch.mm, torch.addmm) if single else (torch.bmm, torch.baddbmm)
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        s = scale if i == last else 1.0
        A = mm(Y.mT, Y) if tall else mm(Y, Y.mT)  # [B, m, m]
        B = addmm(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        if tall:
            Y = addmm(Y, Y, B, beta=a * s, alpha=s)  # s·(a·X + X·B)
        else:
            Y = addmm(Y, B, Y, beta=a * s, alpha=s)  # s·(a·X + B·X)
    return Y.unsqueeze(0) if single else Y


def _ns_gram(
    X: torch.Tensor,
    coeffs: Sequence[Coefficients],
    scale: float = 1.0,
    inv_norm: torch.Tensor | None = None,
    restart: int = GRAM_RESTART,
    symmetric: bool = False,
) -> torch.Tensor:
    """Gram-space NS on a stack X [B, r, c] (bf16, contiguous, either orientation).

    ``inv_norm`` [B] (fp32): per-matrix factor applied to X first (the Frobenius scaling, folded
    into the Gram and into Q, so X itself is never rescaled); None when X is already scaled.
    Returns ``scale · NS(inv_norm · X)`` (bf16, X's orientation). Wide: ``X_k = Q_k X``; tall:
    ``X_k = X Q_kᵀ`` with ``A = XᵀX``. Every product is one bf16 cuBLAS call (fp32 accumulation),
    except with ``symmetric``: the Gram of X and ``b·A + c·A²`` (symmetric results) go through
    the Triton upper-triangle kernel (``_triton_ns.gram``), half their FLOPs.
    """
    tall = X.size(-2) > X.size(-1)
    if symmetric:
        if not _triton_usable(X):
            raise RuntimeError(
                "the Gram form's Triton kernels need triton and a CUDA tensor (or "
                "TRITON_INTERPRET=1 for CPU tests); use backend='torch' or 'auto' here"
            )
        from ._triton_ns import gram as sym_gram

    def gram(Y: torch.Tensor) -> torch.Tensor:  # [B, m, m]
        if symmetric:
            return sym_gram(Y.mT if tall else Y)
        return torch.bmm(Y.mT, Y) if tall else torch.bmm(Y, Y.mT)

    def poly(A: torch.Tensor, b: float, c: float) -> torch.Tensor:  # b·A + c·A²
        if symmetric:  # A is symmetric: A² = A Aᵀ
            return sym_gram(A, epilogue=A, alpha=c, beta=b)
        return torch.baddbmm(A, A, A, beta=b, alpha=c)

    def apply(Q: torch.Tensor, Y: torch.Tensor, s: float) -> torch.Tensor:  # s·Q·Y / s·Y·Qᵀ
        lhs, rhs = (Y, Q.mT) if tall else (Q, Y)
        if s == 1.0:
            return torch.bmm(lhs, rhs)
        out = torch.empty_like(Y)
        return torch.baddbmm(out, lhs, rhs, beta=0.0, alpha=s)

    A = gram(X)
    qscale = inv_norm  # pending per-matrix factor of Q (folded in once, in fp32)
    if qscale is not None:
        A.mul_((qscale * qscale).view(-1, 1, 1))
    Y, Q = X, None
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        # M = a·I + B is never rounded to bf16 (its diagonal would swamp B): every product with
        # M is a GEMM whose fp32 epilogue adds the a·(...) term.
        B = poly(A, b, c)
        if Q is None:  # Q = M (times the pending scale), one rounding
            Qf = B.float()
            Qf.diagonal(dim1=-2, dim2=-1).add_(a)
            if qscale is not None:
                Qf.mul_(qscale.view(-1, 1, 1))
                qscale = None
            Q = Qf.to(torch.bfloat16)
        else:
            Q = torch.baddbmm(Q, B, Q, beta=a)  # M·Q
        if i == last:
            break
        if restart and (i + 1) % restart == 0:  # X_k = Q_k X_0, fresh Gram
            Y = apply(Q, Y, 1.0)
            A, Q = gram(Y), None
            continue
        MA = torch.baddbmm(A, B, A, beta=a)  # M·A
        A = torch.baddbmm(MA, MA, B, beta=a)  # M·A·M (= M²A: all of them commute)
    assert Q is not None
    return apply(Q, Y, scale)


def _use_gram(method: Method, backend: Backend, rows: int, cols: int) -> bool:
    """Whether ``method`` means the Gram form for a ``rows × cols`` matrix (see GRAM_MIN_ASPECT;
    an explicit ``backend="triton"`` keeps "auto" on the Triton standard iteration)."""
    if method not in ("auto", "standard", "gram"):
        raise ValueError(f"method must be 'auto', 'standard' or 'gram', got {method!r}")
    if method == "auto":
        return backend != "triton" and max(rows, cols) >= GRAM_MIN_ASPECT * min(rows, cols)
    return method == "gram"


# Below this much work per Gram (B·m²·n) the Triton kernels lose to cuBLAS: too few tiles to
# fill the GPU and the autotuned launch costs more host time than the GPU work.
_TRITON_MIN_WORK = 1 << 34
# The Gram form's symmetric products pay on Triton from this much work per stack. H200,
# 2026-12-04 (benchmarks/RESULTS.md, bench_muon): one 2048x11008 matrix (B·m²·n = 4.6e10) 1.41 ms
# on Triton vs 1.16 on cuBLAS, one 4096x14336 (2.4e11) 5.62 vs 6.66, one 8192x28672 42.1 vs
# 50.3; the Qwen2.5-VL-3B step 205.5 vs 229.6 ms (measured at a 2^34 threshold: its Gram-form
# stacks are >= 1.8e11 but for the k/v stack, 9.7e9, and the merger's one 2048x5120, 2.1e10,
# which this threshold keeps on cuBLAS).
_GRAM_TRITON_MIN_WORK = 1 << 37


def _gram_symmetric(backend: Backend, X: torch.Tensor) -> bool:
    """Whether the Gram form runs its symmetric products on Triton's upper-triangle kernel:
    always with ``backend="triton"``; with ``"auto"`` on CUDA for stacks with enough work
    (``_GRAM_TRITON_MIN_WORK``) unless ``LMMS_OPTIM_GRAM_TRITON=0`` (cuBLAS for every product)."""
    if backend == "triton":
        return True
    if backend != "auto" or os.environ.get("LMMS_OPTIM_GRAM_TRITON") == "0" or not X.is_cuda:
        return False
    nb, r, c = X.shape
    m, n = min(r, c), max(r, c)
    return nb * m * m * n >= _GRAM_TRITON_MIN_WORK and _triton_usable(X)


def _ns_stack(
    X: torch.Tensor, coeffs: Sequence[Coefficients], backend: Backend, scale: float = 1.0
) -> torch.Tensor:
    """Standard NS on a prepared stack X [B, r, c] (bf16, contiguous, scaled; may be reused).

    Returns ``scale · NS(X)`` in X's orientation (for a tall stack on Triton: a transposed view).
    ``"auto"`` takes Triton on CUDA for stacks with enough work.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    nb, m, n = X.shape
    m, n = min(m, n), max(m, n)
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

    if X.size(-2) > X.size(-1):  # the Triton kernels take the wide orientation
        return ns_triton(X.mT.contiguous(), coeffs, scale=scale).mT
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
    method: Method = "auto",
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate orthogonal polar factor of ``G`` (``[m, n]`` or a stack ``[..., m, n]``).

    Returns bf16 of the same shape. Each matrix of a stack is scaled by its own Frobenius norm.
    ``method``: ``"standard"`` (the published iteration), ``"gram"`` (the same polynomial on
    ``m × m`` matrices, cuBLAS, or with ``backend="triton"`` its symmetric products in Triton's
    upper-triangle kernel; see the module docstring) or ``"auto"`` (Gram when the aspect ratio
    is at least ``GRAM_MIN_ASPECT`` and ``backend`` is not ``"triton"``).
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
    X, inv = _prepare_stack(G, schedule.norm_scale, eps)
    if _use_gram(method, backend, G.size(-2), G.size(-1)):
        out = _ns_gram(X, coeffs, inv_norm=inv, symmetric=_gram_symmetric(backend, X))
    else:
        out = _ns_stack(X.mul_(inv.view(-1, 1, 1)), coeffs, backend)
    return out.reshape(G.shape)


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
