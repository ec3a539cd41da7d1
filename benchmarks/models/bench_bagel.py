"""BAGEL-7B-MoT-shaped training step on one GPU: packed mixed understanding + generation rows.

The 7B-MoT preset (Qwen2.5-7B x 2 experts, SigLIP so400m 26 layers, 16-channel latents in 2 x 2
patches) with ``--layers`` decoder layers (what fits one H200 with fp32 masters and AdamW: each MoT
layer is ~466M parameters = ~7.5 GB of weights + grads + Adam states), random weights, one packed
row of ``--tokens`` tokens mixing understanding samples (a ``--vit-side`` px image through the
ViT + a caption) and generation samples (a caption + ``--gen-side`` px image as latents /8, noised).
bf16 autocast, fused AdamW, FlexAttention block mask for the span rules (``--attn sdpa`` for the
per-sample reference), objective ``ce_flow_matching``.

MFU = ``BagelSpec.mot_flops`` (6 x matmul parameters of the one expert each token runs, attention
over the mask's allowed pairs, the ViT over its own images, the LM head on supervised text) /
step time / 989 TFLOP/s (H200 dense bf16). Published BAGEL training: 25-30 % on 32 x H100.

    python benchmarks/models/bench_bagel.py                       # 8 layers, 16k tokens
    python benchmarks/models/bench_bagel.py --layers 10 --steps 6 --write
    python benchmarks/models/bench_bagel.py --cpu --tiny          # plumbing check on CPU
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402

PEAK = 989e12


def _row(cfg, tokens: int, vit_side: int, gen_side: int, attn: str, seed: int) -> dict:
    from lmms_models.families.bagel import pack_samples

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lat = gen_side // cfg.vae_downsample
    samples, used, i = [], 0, 0
    while True:
        text = {
            "type": "text",
            "ids": [rng.randrange(10, 1000) for _ in range(rng.randint(32, 256))],
        }
        if i % 2 == 0:
            img = {"type": "vit", "pixels": torch.randn(3, vit_side, vit_side, generator=g)}
            sample = [img, {**text, "loss": True}]
            n = (vit_side // cfg.vit.patch_size) ** 2 + 2 + len(text["ids"])
        else:
            img = {
                "type": "vae_gen",
                "latents": torch.randn(cfg.latent_channels, lat, lat, generator=g),
            }
            sample = [{**text, "loss": False}, img]
            n = (lat // cfg.latent_patch_size) ** 2 + 2 + len(text["ids"])
        if used + n > tokens and samples:
            break
        samples.append(sample)
        used, i = used + n, i + 1
    return pack_samples(samples, cfg, start_of_image=1, end_of_image=2,
                        seeds=list(range(seed * 1000, seed * 1000 + len(samples))), backend=attn)  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from lmms_models import get_model_spec
    from lmms_models.families.bagel import batch_to
    from lmms_models.objectives import ObjectiveContext, get_objective

    device = torch.device("cpu" if args.cpu else "cuda")
    spec = get_model_spec("bagel")
    conf = spec.tiny_config() if args.tiny else spec.preset("7b-mot")
    conf = {**conf, "llm": {**conf["llm"], "num_hidden_layers": args.layers}}
    cfg = spec.make_config(conf)
    model = spec.build(config=conf, device=device)
    obj = get_objective("ce_flow_matching")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not args.cpu)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.cpu)
    times, flops, ntok = [], [], []
    for step in range(args.steps):
        # the same samples every step: one row length, so the compiled FlexAttention (static
        # shapes) compiles once, in the untimed warm-up steps; the block mask is still built
        # per step, inside the timed region, as in training
        row = _row(cfg, args.tokens, args.vit_side, args.gen_side, args.attn, 0)
        flops.append(spec.mot_flops(conf, row))
        ntok.append(int(row["input_ids"].numel()))
        row = batch_to(row, device)
        if not args.cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with amp:
            out = obj.loss(spec, model, row, ObjectiveContext(seed=0, step=step))
        (out.loss_sum / out.count).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if not args.cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    keep = slice(2, None) if args.steps > 3 else slice(0, None)  # first steps compile/warm up
    step_s = sum(times[keep]) / len(times[keep])
    f = sum(flops[keep]) / len(flops[keep])
    return {
        "layers": args.layers, "attn": args.attn, "tokens/step": sum(ntok) // len(ntok),
        "step s": round(step_s, 3), "tokens/s": round(sum(ntok) / len(ntok) / step_s),
        "MFU %": round(100 * f / step_s / PEAK, 1) if not args.cpu else None,
        "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1) if not args.cpu else None,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vit-side", type=int, default=448)
    p.add_argument("--gen-side", type=int, default=512)
    p.add_argument("--attn", choices=("flex", "sdpa"), default="flex")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    args = p.parse_args()
    if args.tiny:
        args.vit_side, args.gen_side, args.tokens = 16, 32, 256
    if args.cpu and args.attn == "flex":
        args.attn = "sdpa"  # FlexAttention has no CPU backward
    rows = [run(args)]
    cols = ["layers", "attn", "tokens/step", "step s", "tokens/s", "MFU %", "peak GiB"]
    meta = {"command": "python " + " ".join(sys.argv),
            "header": f"BAGEL-7B-MoT-shaped ({args.layers} layers) packed mixed training step"}  # fmt: skip
    harness.report("bench_bagel", "BAGEL-7B-MoT packed mixed step (one H200)", rows, cols, meta,
                   write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
