"""lmms-optim on one GPU: Newton–Schulz per shape and a whole-model Muon step, with verdicts.

Baselines measured in the same run: the published torch NS5 per matrix
(``lmms_optim.newton_schulz_reference``), a per-matrix torch-reference Muon step, and a fused
torch AdamW step. Shapes come from ``--shapes``; the model is a Qwen2.5-VL-3B-shaped parameter
set (LM + vision tower) built from its config numbers (no weights needed).

    python benchmarks/optim/bench_muon.py [--write] [--shapes 896x896,...]

Prints a table and a PASS/FAIL verdict per target; JSON goes to $OUT/bench_muon.json if OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import unittest.mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness

import lmms_optim as lo
from lmms_optim._triton_ns import ns_triton

DEFAULT_SHAPES = "896x896,896x4864,2048x11008,4096x4096,4096x14336,8192x28672"
JORDAN5 = lo.COEFFICIENT_SCHEDULES["jordan"].for_steps(5)
DEVICE = "cuda"
SCALE = 1  # --smoke divides every model dimension by this (CPU dry run of the script itself)


def cuda_time(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds per call, CUDA events."""
    if DEVICE == "cpu":
        return harness.timeit(fn, repeat=iters, warmup=warmup).wall_median
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def qwen25_vl_3b_params() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of Qwen2.5-VL-3B (tied embeddings): LM, vision tower, merger."""
    d = lambda v: max(2, v // SCALE)  # noqa: E731
    shapes: dict[str, tuple[int, ...]] = {"embed": (d(151936), d(2048)), "lm_norm": (d(2048),)}
    h, inter, kv = d(2048), d(11008), d(256)
    for i in range(36):
        p = f"lm.{i}."
        shapes |= {p + "q": (h, h), p + "k": (kv, h), p + "v": (kv, h), p + "o": (h, h),
                   p + "q_b": (h,), p + "k_b": (kv,), p + "v_b": (kv,),
                   p + "gate": (inter, h), p + "up": (inter, h), p + "down": (h, inter),
                   p + "ln1": (h,), p + "ln2": (h,)}  # fmt: skip
    vh, vi = d(1280), d(3420)
    shapes["patch_embed"] = (vh, 3, 2, 14, 14)
    for i in range(32):
        p = f"vis.{i}."
        shapes |= {p + "qkv": (3 * vh, vh), p + "qkv_b": (3 * vh,), p + "proj": (vh, vh),
                   p + "proj_b": (vh,), p + "gate": (vi, vh), p + "up": (vi, vh),
                   p + "down": (vh, vi), p + "gate_b": (vi,), p + "up_b": (vi,),
                   p + "down_b": (vh,), p + "n1": (vh,), p + "n2": (vh,)}  # fmt: skip
    shapes |= {"merger.ln": (vh,), "merger.fc1": (4 * vh, 4 * vh), "merger.fc1_b": (4 * vh,),
               "merger.fc2": (h, 4 * vh), "merger.fc2_b": (h,)}  # fmt: skip
    return shapes


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def flops(m: int, n: int, method: str) -> float:
    """FLOP model of 5 NS steps on an m×n matrix (m <= n): standard 5·(4m²n + 2m³); Gram form
    with one restart (benchmarks/optim/ns_accuracy.py, docs/muon.md) 8m²n + 28m³."""
    m, n = min(m, n), max(m, n)
    return 5 * (4 * m * m * n + 2 * m**3) if method == "standard" else 8 * m * m * n + 28 * m**3


def cuda_time_interleaved(fns: dict, trials: int, inner: int = 8) -> dict[str, float]:
    """Median seconds per call of each of ``fns``: ``trials`` rounds, each timing ``inner``
    back-to-back calls of every function in turn (CUDA events around the batch).

    Back-to-back calls keep the GPU queue full, as in an optimizer step that orthogonalises one
    matrix after another, so the figure is GPU time, not Python launch latency; interleaving the
    functions round by round gives every one the same clocks and temperature (single-call timings
    of the same code path moved by 4-8% between runs on the H200).
    """
    if DEVICE == "cpu":
        return {k: cuda_time(f, trials) for k, f in fns.items()}
    for f in fns.values():
        f(), f()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(trials):
        for k, f in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                f()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b) / 1e3 / inner)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def bench_one(m: int, n: int, iters: int) -> dict:
    G = torch.randn(m, n, device=DEVICE)
    W = G if m <= n else G.mT  # the Triton kernels take the wide orientation
    X3 = (W / W.norm()).to(torch.bfloat16).contiguous().reshape(1, min(m, n), max(m, n))
    fns = {
        "ref": lambda: lo.newton_schulz_reference(G),
        "lmms": lambda: lo.newton_schulz(G),
        "std": lambda: lo.newton_schulz(G, method="standard"),
        "gram": lambda: lo.newton_schulz(G, method="gram"),
        "torch": lambda: lo.newton_schulz(G, backend="torch"),
    }
    if DEVICE == "cuda":  # the Triton-only variants need the GPU
        fns["tri"] = lambda: ns_triton(X3.clone(), JORDAN5, step="triton")
        fns["bad"] = lambda: ns_triton(X3.clone(), JORDAN5, step="baddbmm")
        # the Gram form with its symmetric products on Triton's upper-triangle kernel
        fns["gtri"] = lambda: lo.newton_schulz(G, method="gram", backend="triton")
    # a few calls per batch are enough once one call is tens of ms (8192x28672)
    t = cuda_time_interleaved(fns, iters, inner=8 if m * n <= 1 << 26 else 2)
    t_ref, t_lmms, t_std, t_gram, t_torch = (t[k] for k in ("ref", "lmms", "std", "gram", "torch"))
    t_tri, t_bad = t.get("tri", float("nan")), t.get("bad", float("nan"))
    t_gtri = t.get("gtri", float("nan"))
    ref = lo.newton_schulz_reference(G)
    err = rel(lo.newton_schulz(G), ref)
    err_gram = rel(lo.newton_schulz(G, method="gram"), ref)
    err_gtri = rel(fns["gtri"](), ref) if "gtri" in fns else float("nan")
    f_std, f_gram = flops(m, n, "standard"), flops(m, n, "gram")
    return dict(shape=f"{m}x{n}", ref_ms=t_ref * 1e3, lmms_ms=t_lmms * 1e3,
                standard_ms=t_std * 1e3, gram_ms=t_gram * 1e3, gram_triton_ms=t_gtri * 1e3,
                triton_step_ms=t_tri * 1e3, baddbmm_step_ms=t_bad * 1e3,
                torch_backend_ms=t_torch * 1e3, speedup=t_ref / t_lmms,
                gram_speedup=t_ref / t_gram, flop_ratio=f_std / f_gram,
                ref_tflops=f_std / t_ref / 1e12, gram_tflops=f_gram / t_gram / 1e12,
                rel_err=err, gram_rel_err=err_gram, gram_triton_rel_err=err_gtri)  # fmt: skip


def bench_shapes(shapes, iters):
    rows, out = [], []
    for m, n in shapes:
        r = bench_one(m, n, iters)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        out.append(r)
        rows.append([r["shape"], f"{r['ref_ms']:.2f}", f"{r['lmms_ms']:.2f}",
                     f"{r['standard_ms']:.2f}", f"{r['gram_ms']:.2f}", f"{r['gram_triton_ms']:.2f}",
                     f"{r['triton_step_ms']:.2f}", f"{r['baddbmm_step_ms']:.2f}",
                     f"{r['torch_backend_ms']:.2f}", f"{r['speedup']:.2f}x",
                     f"{r['gram_speedup']:.2f}x", f"{r['flop_ratio']:.2f}",
                     f"{r['ref_tflops']:.0f}", f"{r['gram_tflops']:.0f}",
                     f"{r['rel_err']:.3f}", f"{r['gram_rel_err']:.3f}",
                     f"{r['gram_triton_rel_err']:.3f}"])  # fmt: skip
    return rows, out


def reference_muon_step(mats, grads, bufs, lr, wd, mom=0.95):
    """Per-matrix torch-reference Muon (published algorithm, adjust_lr='rms')."""
    for p, g, b in zip(mats, grads, bufs):
        b.lerp_(g, 1 - mom)
        u = g.lerp(b, mom)
        o = lo.newton_schulz_reference(u.view(u.size(0), -1))
        p.mul_(1 - lr * wd)
        p.add_(o.view(p.shape), alpha=-lr * lo.lr_scale("rms", p.shape))


def three_pass_step(opt, params, mirrors, scale):
    """What a bf16 run with fp32 masters does around Muon: clip multiply, step, bf16 copy."""
    torch._foreach_mul_([p.grad for p in params], scale)
    opt.step()
    torch._foreach_copy_([mirrors[id(p)] for p in params], params)


def master_muon_step(opt, scale):
    """The same with lmms_optim.MasterMuon: the scale and the copy inside its kernels."""
    opt.clip_scale = scale
    opt.step()


def phase_breakdown(opt, iters: int) -> dict[str, float]:
    """Mean ms per phase of ``opt.step`` (CUDA events at ``Muon.phase_hook`` boundaries; summed
    over buckets for stack / ns / apply)."""
    import itertools
    import time

    marks: list[tuple[str, object]] = []
    now = (lambda: time.perf_counter()) if DEVICE == "cpu" else None

    def record(name: str) -> None:
        if now is not None:
            marks.append((name, now()))
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((name, ev))

    totals: dict[str, float] = {}
    opt.phase_hook = record
    try:
        for _ in range(iters):
            marks.clear()
            record("start")
            opt.step()
            record("end")
            if now is None:
                torch.cuda.synchronize()
            for (_, a), (name, b) in itertools.pairwise(marks):
                ms = (b - a) * 1e3 if now is not None else a.elapsed_time(b)
                name = "tail" if name == "end" else name
                totals[name] = totals.get(name, 0.0) + ms / iters
    finally:
        opt.phase_hook = None
    return totals


def bench_model(iters):
    torch.manual_seed(0)
    shapes = qwen25_vl_3b_params()
    mk = lambda s: torch.nn.Parameter(torch.randn(s, device=DEVICE) * 0.02)  # noqa: E731
    params = {k: mk(s) for k, s in shapes.items()}
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    is_mat = lambda k, p: p.ndim == 2 and k != "embed"  # noqa: E731
    mats = [p for k, p in params.items() if is_mat(k, p)]
    rest = [p for k, p in params.items() if not is_mat(k, p)]
    n_params = sum(p.numel() for p in params.values())
    groups = [{"params": mats, "use_muon": True}, {"params": rest, "use_muon": False}]
    lr, wd = 1e-3, 0.1
    opt = lo.Muon(groups, lr=lr, weight_decay=wd, adjust_lr="rms", adamw_weight_decay=wd)
    ref_mats = [p.detach().clone() for p in mats]
    ref_grads = [p.grad for p in mats]
    ref_bufs = [torch.zeros_like(p) for p in mats]
    fused = DEVICE == "cuda"
    adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=wd, fused=fused)

    # parity: one step from identical states
    before = [p.detach().clone() for p in mats]
    opt.step()
    reference_muon_step(ref_mats, ref_grads, ref_bufs, lr, wd)
    errs = [rel(p.detach() - b, r - b) for p, r, b in zip(mats, ref_mats, before)]
    del before
    worst = max(errs)
    t_lmms = cuda_time(opt.step, iters, warmup=1)
    phases = phase_breakdown(opt, iters)
    opt.ns_method = "standard"  # the same optimizer with the Gram form off, for comparison
    t_std = cuda_time(opt.step, iters, warmup=1)
    phases_std = phase_breakdown(opt, iters)
    opt.ns_method = "auto"
    # the Gram form's products all on cuBLAS (the default before 2026-12-04), for comparison
    with unittest.mock.patch.dict(os.environ, {"LMMS_OPTIM_GRAM_TRITON": "0"}):
        t_gcub = cuda_time(opt.step, iters, warmup=1)
        phases_gcub = phase_breakdown(opt, iters)
    ref_step = functools.partial(reference_muon_step, ref_mats, ref_grads, ref_bufs, lr, wd)
    t_ref_mats = cuda_time(ref_step, iters, warmup=1)
    t_adamw_rest = cuda_time(adamw.step, iters, warmup=1)
    peak = torch.cuda.max_memory_allocated() / 2**30 if fused else 0.0
    # with bf16 model weights from fp32 masters: the three-pass step against MasterMuon
    all_params = list(params.values())
    mirrors = {id(p): torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE) for p in all_params}
    one = torch.ones((), device=DEVICE)  # a clip scale of 1: the passes run, the values stay
    t_three = cuda_time(functools.partial(three_pass_step, opt, all_params, mirrors, one), iters, 1)
    del opt, adamw, ref_mats, ref_bufs, ref_step  # free memory before the all-params AdamW baseline
    master = lo.MasterMuon(groups, lr=lr, weight_decay=wd, adjust_lr="rms", adamw_weight_decay=wd)
    master.set_mirrors(mirrors)
    t_master = cuda_time(functools.partial(master_muon_step, master, one), iters, warmup=1)
    del master, mirrors
    adamw_all = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=wd, fused=fused)
    t_adamw_all = cuda_time(adamw_all.step, iters, warmup=1)
    t_ref = t_ref_mats + t_adamw_rest
    return dict(
        n_params=n_params, n_matrices=len(mats), lmms_ms=t_lmms * 1e3, ref_ms=t_ref * 1e3,
        ref_matrix_part_ms=t_ref_mats * 1e3, adamw_rest_ms=t_adamw_rest * 1e3,
        fused_adamw_all_ms=t_adamw_all * 1e3, speedup=t_ref / t_lmms, worst_rel_err=worst,
        peak_gib=peak, phases_ms=phases, standard_ms=t_std * 1e3,
        phases_standard_ms=phases_std, gram_cublas_ms=t_gcub * 1e3,
        phases_gram_cublas_ms=phases_gcub, three_pass_ms=t_three * 1e3, master_muon_ms=t_master * 1e3,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--write", action="store_true", help="write the section of RESULTS.md")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run at 1/32 size")
    args = ap.parse_args()
    if args.smoke:
        global DEVICE, SCALE
        DEVICE, SCALE, args.iters = "cpu", 32, 2
        args.shapes = "28x28,28x152,64x344,128x128"
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows, shape_res = bench_shapes(shapes, args.iters)
    model = bench_model(max(3, args.iters // 2))
    verdicts = []
    big = [r for r in shape_res if min(map(int, r["shape"].split("x"))) >= 4096 // SCALE]
    for r in big:
        verdicts.append((f"NS {r['shape']} >= 1.3x reference", r["speedup"] >= 1.3))
    verdicts.append(("whole-model Muon step >= 2x per-matrix reference", model["speedup"] >= 2.0))
    verdicts.append(
        ("whole-model updates within bf16 tolerance (rel < 0.06)", model["worst_rel_err"] < 0.06)
    )
    verdicts.append(
        (
            "NS outputs within bf16 tolerance (rel < 0.06)",
            all(r["rel_err"] < 0.06 for r in shape_res),
        )
    )

    t1 = harness.markdown_table(
        ["shape", "torch ref NS5 ms", "lmms (auto) ms", "standard ms", "gram ms", "gram triton ms",
         "triton step ms", "cuBLAS step ms", "torch backend ms", "speedup (auto)",
         "speedup (gram)", "FLOPs std/gram", "ref TFLOP/s", "gram TFLOP/s", "rel err",
         "gram rel err", "gram triton rel err"], rows)  # fmt: skip
    m = model
    t2 = harness.markdown_table(
        ["step (Qwen2.5-VL-3B shapes)", "ms", "vs reference"],
        [["per-matrix torch-reference Muon + fused AdamW (rest)", f"{m['ref_ms']:.1f}", "1.00x"],
         ["lmms_optim.Muon (default: ns_method=auto)", f"{m['lmms_ms']:.1f}", f"{m['speedup']:.2f}x"],
         ["lmms_optim.Muon (ns_method=standard)", f"{m['standard_ms']:.1f}", f"{m['ref_ms'] / m['standard_ms']:.2f}x"],
         ["lmms_optim.Muon (auto, LMMS_OPTIM_GRAM_TRITON=0: Gram form on cuBLAS)", f"{m['gram_cublas_ms']:.1f}", f"{m['ref_ms'] / m['gram_cublas_ms']:.2f}x"],
         ["fused torch AdamW, all params", f"{m['fused_adamw_all_ms']:.1f}", f"{m['ref_ms'] / m['fused_adamw_all_ms']:.2f}x"],
         ["bf16 weights: clip multiply + lmms_optim.Muon + copy (three passes)", f"{m['three_pass_ms']:.1f}", f"{m['ref_ms'] / m['three_pass_ms']:.2f}x"],
         ["bf16 weights: lmms_optim.MasterMuon (clip and write-back fused)", f"{m['master_muon_ms']:.1f}", f"{m['ref_ms'] / m['master_muon_ms']:.2f}x"]],
    )  # fmt: skip
    ph, ph_std, ph_gt = m["phases_ms"], m["phases_standard_ms"], m["phases_gram_cublas_ms"]
    t_ph = harness.markdown_table(
        ["lmms_optim.Muon phase", "ms (auto)", "share", "ms (standard)", "ms (Gram on cuBLAS)"],
        [[k, f"{v:.1f}", f"{v / max(sum(ph.values()), 1e-9):.0%}", f"{ph_std.get(k, 0.0):.1f}",
          f"{ph_gt.get(k, 0.0):.1f}"] for k, v in ph.items()],
    )  # fmt: skip
    t3 = harness.markdown_table(
        ["target", "verdict"], [[v, "PASS" if ok else "FAIL"] for v, ok in verdicts]
    )
    notes = (f"{m['n_params'] / 1e9:.2f}B params, {m['n_matrices']} Muon matrices; worst per-matrix "
             f"update rel. error vs reference {m['worst_rel_err']:.3f}; peak {m['peak_gib']:.0f} GiB. "
             "lmms = defaults: ns_method='auto' (Gram form for aspect >= 2.5, one restart, its "
             "symmetric products on Triton's upper-triangle kernel for stacks of B*m^2*n >= 2^37, "
             "cuBLAS bf16 below) and backend='auto' (Triton symmetric Gram kernels + cuBLAS fused "
             "step for the standard iteration). Per-shape NS times: median over --iters rounds, each "
             "timing 8 back-to-back calls (2 for 8192x28672) of every implementation in turn "
             "(interleaved, same clocks); model steps: median of single steps.")  # fmt: skip
    body = f"{t1}\n\n{t2}\n\n{notes}\n\n{t_ph}\n\n{t3}\n"
    title = "lmms-optim: Newton-Schulz and Muon step (benchmarks/optim/bench_muon.py)"
    command = "python benchmarks/optim/bench_muon.py --write"
    if args.write and not args.smoke:
        harness.write_section(title, body, command=command)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    if os.environ.get("OUT"):  # the section alone, for copying into RESULTS.md from a remote run
        harness.write_section(
            title, body, command=command, results=Path(os.environ["OUT"], "RESULTS_optim.md")
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_muon.json").write_text(
            json.dumps({"shapes": shape_res, "model": model, "verdicts": verdicts, "env": harness.environment()}, indent=1))  # fmt: skip
    print(body)
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
