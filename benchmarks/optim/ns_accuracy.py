"""Accuracy of Gram-space Newton–Schulz variants against float64, on CPU (no GPU needed).

For a wide ``X0`` (m <= n) every NS iterate is ``X_k = Q_k X0`` with ``Q_k`` a polynomial in
``A0 = X0 X0ᵀ``, so the iteration can run on ``m × m`` matrices only (see docs/muon.md). This
script measures, for several precisions of that ``m × m`` recursion, the relative error against
a float64 run of the same 5-step polynomial, next to the plain bf16 iteration's own error (the
bar). GPU arithmetic is emulated exactly: a bf16 GEMM is ``(a.float() @ b.float())`` rounded once
(bf16 inputs, fp32 accumulation); a TF32 GEMM rounds its fp32 inputs to 10 mantissa bits first.

    python benchmarks/optim/ns_accuracy.py [--shapes 256x1024,512x2816,1024x4096] [--write]

``--write`` puts the table into benchmarks/RESULTS.md (section "lmms-optim: Gram NS accuracy").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness

import lmms_optim as lo
from lmms_optim._ns import _ns_gram

JORDAN = lo.COEFFICIENT_SCHEDULES["jordan"].for_steps(5)


def tf32(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to TF32 (10 explicit mantissa bits, round to nearest even)."""
    i = t.float().contiguous().view(torch.int32)
    i = (i + 0xFFF + ((i >> 13) & 1)) & ~0x1FFF
    return i.view(torch.float32)


def mm_bf16(a, b):  # bf16 inputs, fp32 accumulation, bf16 out
    return (a.bfloat16().float() @ b.bfloat16().float()).bfloat16().float()


def mm_tf32(a, b):
    return tf32(a) @ tf32(b)


def mm_fp32(a, b):
    return a.float() @ b.float()


def gram_emulated(X0: torch.Tensor, coeffs, mm, final: str, restart: int = 0) -> torch.Tensor:
    """Gram NS on one wide bf16 matrix X0 [m, n] (already scaled) with the m×m products done by
    ``mm``; ``final``: precision of Q in X = Q X0 ("bf16", "tf32", "fp32"); ``restart``: after
    that many steps form X = Q X0 in bf16 and a fresh Gram from it (0: never)."""
    X = X0.bfloat16().float()
    m = X.size(0)
    eye = torch.eye(m)
    fin = {"bf16": lambda q: q.bfloat16().float(), "tf32": tf32, "fp32": lambda q: q}[final]
    A = X @ X.T  # bf16 inputs, fp32 accumulation and output
    Q = None
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        M = a * eye + b * A + c * mm(A, A)
        Q = M if Q is None else mm(M, Q)
        if i == last:
            break
        if restart and i + 1 == restart:
            X = (fin(Q) @ X).bfloat16().float()
            A, Q = X @ X.T, None
            continue
        A = mm(mm(M, A), M)
    return (fin(Q) @ X).bfloat16()


def exact(X0: torch.Tensor, coeffs) -> torch.Tensor:
    X = X0.double()
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


def inputs(kind: str, m: int, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(m, n, generator=g)
    if kind == "lowrank+noise":
        r = max(4, m // 32)
        return torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g) / r**0.5 + 0.05 * (
            torch.randn(m, n, generator=g)
        )
    if kind == "logspread":  # singular values log-spaced over 1e-4..1
        U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
        V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
        s = torch.logspace(0, -4, m, dtype=torch.float64)
        return ((U * s) @ V.T).float()
    if kind == "momentum":  # EMA (mu = 0.95) of 30 grads sharing a slowly drifting low-rank part
        base = torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g) / 8**0.5
        M = torch.zeros(m, n)
        for _ in range(30):
            M.lerp_(base + torch.randn(m, n, generator=g), 0.05)
        return M
    raise ValueError(kind)


KINDS = ("gaussian", "lowrank+noise", "logspread", "momentum")


def variants():
    return {
        "gram fp32 (Q fp32)": dict(mm=mm_fp32, final="fp32"),
        "gram fp32 (Q bf16)": dict(mm=mm_fp32, final="bf16"),
        "gram tf32 (Q tf32)": dict(mm=mm_tf32, final="tf32"),
        "gram bf16": dict(mm=mm_bf16, final="bf16"),
        "gram bf16, restart@2": dict(mm=mm_bf16, final="bf16", restart=2),
        "gram bf16, restart@3": dict(mm=mm_bf16, final="bf16", restart=3),
    }


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="256x1024,512x2816,1024x4096")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    names = ["bf16 standard (published)", "lmms gram (shipped)", *variants()]
    rows = []
    for m, n in shapes:
        for kind in KINDS:
            G = inputs(kind, m, n, torch.Generator().manual_seed(m + n))
            X0 = (G / G.norm()).bfloat16()  # the same bf16 start for every variant
            ref = exact(X0, JORDAN)
            errs = [rel(lo.newton_schulz_reference(X0), ref)]
            errs.append(rel(_ns_gram(X0[None], JORDAN)[0], ref))
            errs += [
                rel(gram_emulated(X0.float(), JORDAN, **kw), ref) for kw in variants().values()
            ]
            rows.append([f"{m}x{n}", kind, *(f"{e:.4f}" for e in errs)])
            print(" | ".join(rows[-1]), flush=True)
    table = harness.markdown_table(["shape", "input", *names], rows)
    print(table)
    if args.write:
        harness.write_section(
            "lmms-optim: Gram NS accuracy (benchmarks/optim/ns_accuracy.py)",
            "Relative error (Frobenius) of each variant vs float64 of the same 5-step Jordan "
            "polynomial from the same bf16 start; GPU arithmetic emulated on CPU.\n\n"
            + table
            + "\n",
            command="python benchmarks/optim/ns_accuracy.py --write",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
