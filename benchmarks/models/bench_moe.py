"""Mixture-of-experts speed: one experts layer per implementation, then Qwen3-VL-30B-A3B-shaped
training steps through `lmms-train`, every case measured in the same run.

Kernel (``--kernel``): one experts layer of the 30B-A3B shape (H 2048, I 768, 128 experts, top 8,
bf16) on ``--tokens`` routed tokens, forward + backward, per implementation of transformers'
experts registry: ``eager`` (upstream's per-expert loop), ``grouped_mm`` and ``batched_mm``
(transformers'), ``lmms_grouped`` (lmms-kernels: sorted pairs, one grouped GEMM per projection)
and ``lmms_loop`` (its plain-torch reference). TFLOP/s count the active expert matmuls
(``6 · tokens · k · 3 · H · I``).

Training (default): the ``30b_a3b`` preset with ``--layers`` decoder layers (as many as fit one
H200 with fp32 master weights and AdamW state, ~16 bytes per parameter: a layer holds ~0.63B
parameters, so 6 layers plus embeddings, head and tower are ~4.7B, ~75 GiB before activations;
the full 48 do not fit), random weights, packed
``--T`` tokens, the dense VL benchmark's image mix (benchmarks/train/bench_records.py: 224-672 px
images, long-tailed text), router aux loss on, through the real CLI. Cases differ only in
``trainer_args.experts_backend`` (and the attention backend for the upstream rows). MFU is the
trainer's: active parameters (``6 · lm_matmul_params`` with the top-k experts and the router) plus
attention and the vision tower, against 989 TFLOP/s. "upstream" rows use transformers' eager
experts; ``*_liger`` rows add Liger's RMSNorm (lmms-kernels' Liger plan for qwen3_vl_moe; every
layer is sparse, so there is no dense SwiGLU to swap). ``attn_backend: auto`` takes FA4 where
flash_attn.cute imports (carry the bundle: ../shared/gpu/bundle.sh), torch's varlen otherwise.

    python benchmarks/models/bench_moe.py --kernel                  # ~1 min
    python benchmarks/models/bench_moe.py --layers 6 --T 16384      # ~10 min
    python benchmarks/models/bench_moe.py --kernel --cpu --tokens 256 --shape 64 32 8 2  # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "train"))
import harness  # noqa: E402

KERNEL_IMPLS = ("eager", "grouped_mm", "batched_mm", "lmms_grouped", "lmms_loop")

# name -> trainer_args differences (experts implementation; attention)
CASES: dict[str, dict] = {
    "lmms_grouped": dict(experts_backend="grouped", attn_backend="auto"),
    "lmms_grouped_liger": dict(
        experts_backend="grouped", attn_backend="auto", use_liger_kernel=True
    ),
    "hf_grouped_mm": dict(experts_backend="grouped_mm", attn_backend="auto"),
    "upstream_eager_experts": dict(experts_backend="eager", attn_backend="auto"),
    # upstream's experts loop with FA4 (`auto` where the bundle is on the path) and Liger's
    # RMSNorm: the "upstream + FA4 + Liger" baseline of issue 23
    "upstream_eager_experts_liger": dict(
        experts_backend="eager", attn_backend="auto", use_liger_kernel=True
    ),
    "upstream_eager_experts_sdpa": dict(experts_backend="eager", attn_backend="sdpa"),
}


def _experts_module(device: str, dtype: torch.dtype, impl: str, shape: list[int]):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

    from lmms_kernels import register_experts

    h, inter, n_exp, k = shape
    cfg = Qwen3VLMoeTextConfig(
        hidden_size=h, moe_intermediate_size=inter, num_experts=n_exp, num_experts_per_tok=k
    )
    if impl.startswith("lmms_"):
        impl = register_experts(impl, backend="auto" if impl == "lmms_grouped" else "loop")
    cfg._experts_implementation = impl
    with torch.device(device):
        mod = Qwen3VLMoeTextExperts(cfg)
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return mod.to(dtype), cfg


def run_kernel(args: Namespace) -> list[dict]:
    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    h, inter, n_exp, k = args.shape
    for n in args.tokens:
        x = torch.randn(n, h, device=device, dtype=dtype, generator=gen)
        logits = torch.randn(n, n_exp, device=device, generator=gen) * 2.0  # uneven routing
        w, idx = torch.softmax(logits, -1).topk(k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(dtype)
        flops = 6.0 * n * k * 3 * h * inter
        for impl in args.impls:
            if impl == "batched_mm" and n * k * 2 * inter * h * 2 > 40e9:
                rows.append({"tokens": n, "impl": impl, "status": "skipped (per-pair weights)"})
                continue
            mod, _ = _experts_module(device, dtype, impl, args.shape)
            xb = x.clone().requires_grad_()
            grad = torch.randn_like(x)

            def step(mod=mod, xb=xb, grad=grad, idx=idx, w=w):
                out = mod(xb, idx, w)
                out.backward(grad)
                if device == "cuda":
                    torch.cuda.synchronize()

            try:
                t = harness.timeit(step, repeat=args.iters, warmup=args.warmup)
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                rows.append({"tokens": n, "impl": impl, "status": f"error: {exc}"[:120]})
                continue
            ms = t.wall_median * 1e3
            rows.append({"tokens": n, "impl": impl, "status": "ok", "ms": round(ms, 2),
                         "tflops": round(flops / t.wall_median / 1e12, 1)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del mod, xb
    return rows


def _config(name: str, case: dict, work: Path, args: Namespace) -> dict:
    text = {"num_hidden_layers": args.layers, "output_router_logits": True}
    return {
        "model_config": {
            "load_from_config": {
                "model_type": "qwen3_vl_moe",
                "preset": "30b_a3b",
                "config": {"text_config": text},
            },
            "processor_path": str(work / "processor_qwen3_vl"),
            "build_local_processor": True,
        },
        "dataset_config": {
            "dataset_path": str(work / "data_vl" / "train.parquet"),
            "packing": True,
            "packing_strategy": "first_fit",
            "packing_length": args.T,
            "max_open_bins": 16,
            "num_workers": 10,
            "min_pixels": 224 * 224,
            "max_pixels": 672 * 672,
        },
        "trainer_args": {
            "output_dir": str(work / "runs" / name),
            "max_steps": args.warmup + args.steps,
            "learning_rate": 1e-5,
            "optimizer": "adamw",
            "bf16": True,
            "use_rmpad": True,
            "activation_checkpointing": args.ac,
            "vision_activation_checkpointing": "none",
            "save_final": False,
            "report_to": [],
            "profile_step_breakdown": True,
            "seed": 0,
            **case,
        },
    }


def run_training(args: Namespace) -> list[dict]:
    import bench_train
    from bench_records import make_records, write_parquet

    work = Path(args.work)
    target = work / "data_vl" / "train.parquet"
    if not target.exists():
        write_parquet(make_records(args.records, 0, images=True, tiny=False), target)
    bench_train.lmms_config = _config  # this family's config; bench_train runs and summarises
    ns = Namespace(
        warmup=args.warmup, steps=args.steps, case_timeout=args.case_timeout, profile_steps=None,
        compile=False, loss_backend="auto", vision_attn=None, linear_patch_embed=False,
        fused_master_step=None, muon_fused_step=None, ga=1, ac=None, ac_fraction=None,
        vision_ac=None, vision_ac_fraction=None,
    )  # fmt: skip
    results = []
    for name in args.cases:
        t0 = time.perf_counter()
        res = bench_train.run_lmms(f"moe_{name}", CASES[name], work, ns)
        res["bench_wall_s"] = round(time.perf_counter() - t0, 1)
        res["layers"] = args.layers
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernel", action="store_true", help="the experts-layer benchmark only")
    p.add_argument("--cpu", action="store_true", help="kernel on CPU in fp32 (plumbing check)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument(
        "--shape",
        type=int,
        nargs=4,
        default=[2048, 768, 128, 8],
        metavar=("H", "I", "E", "K"),
        help="experts layer: hidden, expert width, experts, top-k (default: 30B-A3B)",
    )
    p.add_argument("--impls", nargs="+", default=list(KERNEL_IMPLS), choices=KERNEL_IMPLS)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the 30B-A3B shape")
    p.add_argument("--T", type=int, default=16384, help="packing length")
    p.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--work", default="/tmp/lmms-bench-moe")
    p.add_argument("--case-timeout", type=int, default=900)
    p.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md sections")
    args = p.parse_args()
    command = "python benchmarks/models/bench_moe.py " + " ".join(sys.argv[1:])
    if args.kernel:
        rows = run_kernel(args)
        cols = ["tokens", "impl", "status", "ms", "tflops"]
        title = "lmms-kernels: MoE experts layer (30B-A3B shape), forward + backward"
    else:
        rows = run_training(args)
        cols = ["case", "status", "layers", "T", "tok_s", "mfu", "mfu_lm", "peak_gib", "step_s"]
        title = "Qwen3-VL-30B-A3B-shaped training step: experts implementations"
    table = harness.markdown_table(cols, [[r.get(c, "-") for c in cols] for r in rows])
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        name = "bench_moe_kernel.json" if args.kernel else "bench_moe.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(rows, indent=1))
    if args.write:
        harness.write_section(title, table, command=command)


if __name__ == "__main__":
    main()
