"""Diffusion-transformer training speed: Wan2.1-1.3B at 480p x 81 frames and SiT-XL/2 at 256 px,
lmms (spec + flow_matching objective, per-block torch.compile, activation checkpointing as set)
against the plain diffusers-style loop (the model called directly, MSE on `noise - x`, no
compile), both in the same run on random weights and random latents/text states.

One H200 (single process): fp32 master weights, bf16 autocast, fused AdamW, the real shapes
(Wan: latents 16 x 21 x 60 x 104 = 32,760 video tokens, 512 text tokens of 4096; SiT: 32 x 32 x 4
latents, patch 2 = 256 tokens). MFU = the spec's training FLOPs (`spec.lm_flops`: 6N per token
+ self- and cross-attention) / step time / 989 TFLOP/s (dense bf16 datasheet; recompute not
counted).

    python benchmarks/models/bench_diffusion.py                     # both models, ~5 min
    python benchmarks/models/bench_diffusion.py --model wan --steps 6
    python benchmarks/models/bench_diffusion.py --cpu --tiny        # plumbing check on CPU

diffusers is not on the device image: carry it (pure Python) and put it on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402

PEAK = 989e12


def _case(name: str, tiny: bool) -> tuple[str, dict, dict]:
    """(family, config dict, batch shapes)."""
    from lmms_models import get_model_spec

    if name == "wan":
        spec = get_model_spec("wan")
        conf = spec.tiny_config() if tiny else spec.preset("1.3b")
        lat = (4, 3, 8, 8) if tiny else (16, 21, 60, 104)
        text = (8, conf["text_dim"]) if tiny else (512, 4096)
        return "wan", conf, {"latents": lat, "text": text, "batch": 1}
    spec = get_model_spec("sit")
    conf = spec.tiny_config() if tiny else spec.preset("XL/2")
    lat = (3, 8, 8) if tiny else (4, 32, 32)
    return (
        "sit",
        conf,
        {
            "latents": lat,
            "batch": 4 if tiny else 64,
            "classes": conf.get("num_classes", 1000),
        },
    )


def _batch(family: str, shapes: dict, device: torch.device, step: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(step)
    b = shapes["batch"]
    out = {"latents": torch.randn((b, *shapes["latents"]), generator=g).to(device),
           "noise_seed": torch.arange(b) + step * b, "num_loss_tokens": b}  # fmt: skip
    if family == "wan":
        out["text_embeds"] = torch.randn((b, *shapes["text"]), generator=g).to(device)
    else:
        out["class_labels"] = torch.randint(0, shapes["classes"], (b,), generator=g).to(device)
    return out


def run(name: str, mode: str, args: argparse.Namespace) -> dict:
    from lmms_kernels import compile_blocks
    from lmms_models import get_model_spec
    from lmms_models.objectives import ObjectiveContext, get_objective
    from lmms_parallel import apply_activation_checkpointing

    device = torch.device("cpu" if args.cpu else "cuda")
    family, conf, shapes = _case(name, args.tiny)
    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.build(config=conf, device=device)
    hf = spec.make_config(conf)
    opts = {**spec.objective_defaults}
    obj = get_objective("flow_matching", **opts)
    if mode == "lmms":
        if args.ac:
            apply_activation_checkpointing(spec.decoder_blocks(model), "full")
        if not args.cpu and not args.no_compile:
            compile_blocks(spec.decoder_blocks(model))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not args.cpu)
    tokens = spec.tokens_per_sample(hf, shapes["latents"]) * shapes["batch"]
    flops = spec.lm_flops(hf, [tokens // shapes["batch"]] * shapes["batch"])
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.cpu)

    def step(i: int) -> None:
        batch = _batch(family, shapes, device, i)
        with amp:
            if mode == "lmms":
                loss = obj.loss(spec, model, batch, ObjectiveContext(seed=0)).loss_sum
            else:  # the diffusers-style loop: direct call, rectified-flow MSE (sit: SiT's sign)
                x = batch["latents"]
                n = torch.randn_like(x)
                s = torch.rand(x.shape[0], device=device).view(-1, *[1] * (x.ndim - 1))
                xt = (1 - s) * x + s * n
                t = s.flatten() * (1000.0 if family == "wan" else 1.0)
                if family == "wan":
                    out = model(xt, t, batch["text_embeds"], return_dict=False)[0]
                else:
                    out = model(xt, t, batch["class_labels"])[:, : x.shape[1]]
                loss = torch.nn.functional.mse_loss(out.float(), (n - x).float())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return {"model": name, "mode": mode, "tokens/step": tokens, "step s": dt,
            "tokens/s": tokens / dt, "MFU %": 100 * flops / dt / PEAK, "peak GiB": mem}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["wan", "sit", "both"], default="both")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ac", action="store_true", help="full activation checkpointing (lmms rows)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    args = p.parse_args()
    names = ["wan", "sit"] if args.model == "both" else [args.model]
    rows = []
    for name in names:
        for mode in ("lmms", "diffusers"):
            try:
                rows.append(run(name, mode, args))
            except torch.OutOfMemoryError:
                rows.append({"model": name, "mode": mode, "step s": None, "tokens/s": "OOM"})
            if not args.cpu:
                torch.cuda.empty_cache()
    cols = ["model", "mode", "tokens/step", "step s", "tokens/s", "MFU %", "peak GiB"]
    meta = {"command": "python " + " ".join(sys.argv),
            "header": "Wan2.1-1.3B 480p x 81 / SiT-XL/2 256 px training steps"}  # fmt: skip
    harness.report("bench_diffusion", "diffusion transformers: Wan2.1-1.3B and SiT-XL/2", rows,
                   cols, meta, write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
