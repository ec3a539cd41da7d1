"""Varlen attention throughput per backend on packed documents (fwd and fwd+bwd, TFLOP/s).

Each packed row holds documents with log-normal lengths (median ``--doc-median`` tokens, capped at
the row) filling ``T`` tokens. FLOPs count only the attended (q, k) pairs of each document:
``4·H·D·pairs`` forward (``pairs = L(L+1)/2`` causal, ``L²`` bidirectional); fwd+bwd = 3.5x fwd
(backward recomputes QK^T: 2.5x forward). The "sdpa" backend (a loop of SDPA calls, one per
document) is the baseline measured in the same run.

GPU:  python3 benchmarks/kernels/bench_attention.py
CPU:  python benchmarks/kernels/bench_attention.py --tokens 512 --heads 4 --kv-heads 2 --iters 2
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch

import lmms_kernels as lk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import harness


def parse_args() -> argparse.Namespace:
    p = harness.timing_parser(__doc__, tokens=[8192, 16384, 32768], iters=10, warmup=3)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-median", type=int, default=1024)
    p.add_argument("--modes", nargs="+", default=["causal", "bidir"], choices=["causal", "bidir"])
    p.add_argument("--backends", nargs="*", default=None, help="default: all available")
    return p.parse_args()


def pack_lengths(total: int, median: int, gen: torch.Generator) -> list[int]:
    lens, left = [], total
    while left > 0:
        z = float(torch.randn((), generator=gen))
        n = max(16, min(left, int(median * math.exp(0.8 * z))))
        lens.append(n)
        left -= n
    return lens


def _fwd(q, k, v, cu, mx, causal, backend):
    with torch.no_grad():
        lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend=backend)


def _fwd_bwd(q, k, v, go, cu, mx, causal, backend):
    out = lk.varlen_attention(q, k, v, cu, cu, mx, mx, causal=causal, backend=backend)
    torch.autograd.grad(out, (q, k, v), go)


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backends or lk.available_backends(device)
    gen = torch.Generator().manual_seed(args.seed)
    h, kv, d = args.heads, args.kv_heads, args.head_dim
    rows = []
    for t in args.tokens:
        lens = pack_lengths(t, args.doc_median, gen)
        cu = torch.tensor(
            [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device
        )
        mx = max(lens)
        q = torch.randn(t, h, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(t, kv, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(t, kv, d, device=device, dtype=dtype, requires_grad=True)
        go = torch.randn(t, h, d, device=device, dtype=dtype)
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        for mode in args.modes:
            causal = mode == "causal"
            pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
            fwd_flops = 4 * h * d * pairs
            for be in backends:
                fwd = functools.partial(_fwd, qd, kd, vd, cu, mx, causal, be)
                fwd_bwd = functools.partial(_fwd_bwd, q, k, v, go, cu, mx, causal, be)
                row = {"T": t, "docs": len(lens), "mode": mode, "backend": be}
                try:
                    ms_f = harness.device_ms(fwd, device, warmup=args.warmup, iters=args.iters)
                    row.update(fwd_ms=ms_f, fwd_tflops=fwd_flops / ms_f / 1e9)
                    if device.type == "cuda" or be != "flex":  # flex has no CPU backward
                        ms_b = harness.device_ms(
                            fwd_bwd, device, warmup=args.warmup, iters=args.iters
                        )
                        row.update(fwdbwd_ms=ms_b, fwdbwd_tflops=3.5 * fwd_flops / ms_b / 1e9)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:80]
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    meta = harness.torch_meta(dtype, f"H={h} KV={kv} D={d}, doc median {args.doc_median}")
    cols = [
        "T",
        "docs",
        "mode",
        "backend",
        "fwd_ms",
        "fwd_tflops",
        "fwdbwd_ms",
        "fwdbwd_tflops",
        "error",
    ]
    title = (
        "lmms-kernels: varlen attention TFLOP/s per backend (benchmarks/kernels/bench_attention.py)"
    )
    harness.report("bench_attention", title, rows, cols, meta, write=args.write)


if __name__ == "__main__":
    main()
