"""Fused linear cross-entropy vs naive logits + cross-entropy: time (fwd+bwd) and peak memory.

Baseline (same run): ``F.cross_entropy((h @ W.T).float(), y, reduction="sum")`` which
materialises the ``[T, V]`` logits (bf16) and their fp32 copy. Compared: lmms' chunked torch
implementation (``backend="torch"``), lmms' chunked cuBLAS + Triton kernel (``backend="triton"``;
on CPU only under TRITON_INTERPRET=1, where its time means nothing) and Liger's kernel
(``backend="liger"``, when installed).
Peak memory is measured above the inputs (hidden, weight, labels already allocated); 15% of
labels are ignored (-100), like prompt tokens. Shapes default to Qwen2.5-3B (Hd 2048,
V 151936).

GPU:  python3 benchmarks/kernels/bench_flce.py
CPU:  python benchmarks/kernels/bench_flce.py --tokens 256 --hidden 64 --vocab 4096 --iters 2
      (prefix TRITON_INTERPRET=1 to include the triton backend, interpreted)
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import lmms_kernels as lk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import harness


def parse_args() -> argparse.Namespace:
    p = harness.timing_parser(__doc__, tokens=[4096, 16384, 32768], iters=5, warmup=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    return p.parse_args()


def naive(h, w, y):
    logits = h @ w.T  # [T, V]
    return F.cross_entropy(logits.float(), y, reduction="sum", ignore_index=-100)


def _fused(h, w, y, *, backend):
    return lk.fused_linear_cross_entropy(h, w, y, backend=backend)[0]


def _step(fn, h, w, y):
    loss = fn(h, w, y)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss, gh, gw


def _peak_mib(fn, device: torch.device) -> float | None:
    """Peak CUDA memory allocated above the current level while running ``fn()`` once."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(args.seed)
    impls = {"naive": naive, "lmms-torch": None}
    if importlib.util.find_spec("triton") is None:
        print("triton not installed: skipping lmms-triton", file=sys.stderr)
    elif device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        impls["lmms-triton"] = None
    else:
        print("no CUDA and TRITON_INTERPRET unset: skipping lmms-triton", file=sys.stderr)
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        impls["lmms-liger"] = None
    else:
        print("liger-kernel not installed or no CUDA: skipping lmms-liger", file=sys.stderr)
    w = (
        (torch.randn(args.vocab, args.hidden, device=device, generator=gen) * 0.02)
        .to(dtype)
        .requires_grad_()
    )
    rows = []
    for t in args.tokens:
        h = torch.randn(t, args.hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
        y = torch.randint(0, args.vocab, (t,), device=device, generator=gen)
        y[torch.rand(t, device=device, generator=gen) < 0.15] = -100
        ref = None
        for name, fn in impls.items():
            if fn is None:
                fn = functools.partial(_fused, backend=name.split("-")[1])
            step = functools.partial(_step, fn, h, w, y)
            row = {"T": t, "impl": name}
            try:
                loss, gh, gw = step()
                if ref is None:
                    ref = (loss.detach().float(), gh.float(), gw.float())
                row["loss_rel_err"] = float((loss.float() - ref[0]).abs() / ref[0].abs())
                row["grad_h_max_err"] = float((gh.float() - ref[1]).abs().max())
                del loss, gh, gw
                row["ms"] = harness.device_ms(step, device, warmup=args.warmup, iters=args.iters)
                row["peak_mib"] = _peak_mib(step, device)
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
        del h, y, ref, step
    meta = harness.torch_meta(dtype, f"Hd={args.hidden} V={args.vocab}, fwd+bwd")
    cols = ["T", "impl", "ms", "peak_mib", "loss_rel_err", "grad_h_max_err", "error"]
    title = (
        "lmms-kernels: fused linear cross-entropy vs logits + CE (benchmarks/kernels/bench_flce.py)"
    )
    harness.report("bench_flce", title, rows, cols, meta, write=args.write)


if __name__ == "__main__":
    main()
