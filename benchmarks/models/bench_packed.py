"""Packed (rmpad) training step of a Qwen2.5-VL-3B-shaped model vs plain transformers.

One process, one GPU, random weights with the real architecture (``qwen2_5_vl`` preset ``3b``).
Synthetic image+text samples: 224-672 px images (0-2 per sample, ~20% text-only), long-tailed
(log-normal) text lengths. Every configuration trains on the *same* samples:

* ``lmms``: samples packed into rows of ``T`` tokens; ``spec.packed_forward`` (lmms varlen
  attention for the LM and the vision tower, fused linear CE), Liger RMSNorm/SwiGLU through
  ``lmms_kernels.apply_liger`` when available, per-block activation checkpointing (``--ac``).
* ``hf-sdpa`` / ``hf-sdpa-liger``: plain transformers, padded batches of about ``T`` real tokens,
  ``model(..., labels=...)`` with SDPA and gradient checkpointing; the second with liger-kernel's
  own ``apply_liger_kernel_to_qwen2_5_vl`` (RMSNorm, SwiGLU, fused linear CE). Out of memory is
  reported, not fatal.

All: fp32 master weights, bf16 autocast, fused AdamW. Tokens/s counts real (unpadded) tokens.
MFU = FLOPs / time / 989e12 (H100/H200 dense bf16 datasheet peak): LM ``6N + 12·L·h·s`` per token
(full-attention convention of the calibration; recompute not counted), ViT from the image grids
(lmms_models' ``vision_flops``). ``--tiny`` runs the same plumbing on CPU in seconds.

GPU: python3 benchmarks/models/bench_packed.py --tokens 16384 32768
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import time
from typing import Any

import torch

from lmms_models import get_model_spec

PEAK_FLOPS = 989e12


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (plumbing check)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="auto", help="lmms varlen attention backend")
    p.add_argument(
        "--ac",
        nargs="+",
        default=["full"],
        help="activation checkpointing per block for lmms: full, none, selective, or a fraction "
        "of blocks (e.g. 0.5); several values are run one after the other",
    )
    p.add_argument("--no-liger", action="store_true", help="lmms without Liger RMSNorm/SwiGLU")
    p.add_argument(
        "--baselines",
        nargs="*",
        default=["hf-sdpa", "hf-sdpa-liger"],
        help="plain transformers runs",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ----------------------------------------------------------------------------- data
def make_samples(cfg: Any, n_tokens: int, n_packs: int, rng: random.Random, tiny: bool):
    """Sample layouts (no pixels yet) until ``n_packs`` packs of ``n_tokens`` are filled."""
    vc = cfg.vision_config
    merge = vc.spatial_merge_size
    unit = vc.patch_size * merge  # image sides are multiples of this (28 px)
    sides = [2 * unit, 3 * unit] if tiny else list(range(224, 673, unit))
    hi_text = 40 if tiny else 4096
    packs, cur, used = [], [], 0
    while len(packs) < n_packs:
        n_img = 0 if rng.random() < 0.2 else rng.choice([1, 1, 1, 2])
        grids = [(1, s // vc.patch_size, s // vc.patch_size) for s in rng.choices(sides, k=n_img)]
        mu = 2.0 if tiny else 5.5
        n_text = min(hi_text, int(rng.lognormvariate(mu, 0.9))) + 4
        ids: list[int] = []
        for _, h, w in grids:
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (h * w // merge**2)
            ids += [cfg.vision_end_token_id]
        ids += [rng.randrange(10, min(cfg.image_token_id, 150000)) for _ in range(n_text)]
        if len(ids) > n_tokens:
            continue
        if used + len(ids) > n_tokens:
            packs.append(cur)
            cur, used = [], 0
        cur.append({"input_ids": torch.tensor(ids), "grids": grids})
        used += len(ids)
    return packs


def sample_labels(cfg: Any, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    special = torch.tensor([cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id])
    labels[torch.isin(ids, special)] = -100
    labels[:2] = -100
    return labels


def pack_batch(spec, model, pack, n_tokens: int, device) -> dict[str, Any]:
    """The packed batch of docs/contracts.md (pixel values random on the device)."""
    cfg = model.config
    ids, lab, shift, pos, lens, grids = [], [], [], [], [], []
    for s in pack:
        g = torch.tensor(s["grids"], dtype=torch.long).reshape(-1, 3)
        x = s["input_ids"]
        y = sample_labels(cfg, x)
        sh = torch.full_like(y, -100)
        sh[:-1] = y[1:]
        ids.append(x)
        lab.append(y)
        shift.append(sh)
        pos.append(spec.sample_position_ids(model, x, image_grid_thw=g if len(g) else None))
        lens.append(len(x))
        grids.append(g)
    pad = n_tokens - sum(lens)
    if pad > 0:
        ids.append(torch.zeros(pad, dtype=torch.long))
        lab.append(torch.full((pad,), -100))
        shift.append(torch.full((pad,), -100))
        pos.append(torch.arange(pad).expand(4, -1))
        lens.append(pad)
    grid = torch.cat(grids)
    input_ids = torch.cat(ids)
    n_patches = int(grid.prod(-1).sum())
    per_patch = cfg.vision_config.in_channels * cfg.vision_config.temporal_patch_size
    per_patch *= cfg.vision_config.patch_size**2
    batch = {
        "input_ids": input_ids,
        "labels": torch.cat(lab),
        "shift_labels": torch.cat(shift),
        "position_ids": torch.cat(pos, -1),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "max_seqlen": max(lens),
        "mm_token_type_ids": spec.mm_token_type_ids(cfg, input_ids),
    }
    if n_patches:
        batch["pixel_values"] = torch.randn(n_patches, per_patch, device=device)
        batch["image_grid_thw"] = grid
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def padded_batches(model, pack, n_tokens: int, device):
    """Plain-transformers batches for the same samples: rows padded to the longest, about
    ``n_tokens`` real tokens per batch (one batch per pack)."""
    cfg = model.config
    lmax = max(len(s["input_ids"]) for s in pack)
    ids = torch.zeros(len(pack), lmax, dtype=torch.long)
    mask = torch.zeros(len(pack), lmax, dtype=torch.long)
    labels = torch.full((len(pack), lmax), -100)
    for i, s in enumerate(pack):
        n = len(s["input_ids"])
        ids[i, :n] = s["input_ids"]
        mask[i, :n] = 1
        labels[i, :n] = sample_labels(cfg, s["input_ids"])
    grid = torch.tensor([g for s in pack for g in s["grids"]], dtype=torch.long).reshape(-1, 3)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    out["mm_token_type_ids"] = get_model_spec("qwen2_5_vl").mm_token_type_ids(cfg, ids)
    if len(grid):
        vc = cfg.vision_config
        per_patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        out["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), per_patch)
        out["image_grid_thw"] = grid
    return {k: v.to(device) for k, v in out.items()}


# ----------------------------------------------------------------------------- runs
def select_blocks(blocks, frac: float):
    return [b for i, b in enumerate(blocks) if math.floor((i + 1) * frac) > math.floor(i * frac)]


def run(name, step_fn, batches, flops, args, device) -> dict[str, Any]:
    """Time ``step_fn`` over ``batches`` (warmup first); OOM is a result, not a crash."""
    times: list[float] = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for i, batch in enumerate(batches):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step_fn(batch)
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"run": name, "status": "OOM"}
    n_timed = len(times)
    timed = slice(args.warmup, args.warmup + n_timed)
    tok = sum(f["tokens"] for f in flops[timed])
    lm = sum(f["lm"] for f in flops[timed])
    vit = sum(f["vit"] for f in flops[timed])
    tt = sum(times)
    return {
        "run": name,
        "status": "ok",
        "tok_s": round(tok / tt),
        "mfu_total": round((lm + vit) / tt / PEAK_FLOPS, 4),
        "mfu_lm": round(lm / tt / PEAK_FLOPS, 4),
        "vit_flop_share": round(vit / (lm + vit), 3),
        "step_s": round(tt / n_timed, 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else 0.0,
        "loss": round(float(loss), 4),
    }


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        args.tokens = sorted({min(t, 256) for t in args.tokens})
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        torch.set_num_threads(1)
    spec = get_model_spec("qwen2_5_vl")
    config = spec.tiny_config() if args.tiny else spec.preset("3b")
    results: list[dict[str, Any]] = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for n_tokens in args.tokens:
        torch.manual_seed(args.seed)
        n_steps = args.warmup + args.steps
        # ---- lmms
        for ac in args.ac:
            model = spec.build(config=config, device=device, attn_backend=args.backend).train()
            cfg = model.config
            packs = make_samples(cfg, n_tokens, n_steps, random.Random(args.seed), args.tiny)
            flops = []
            for pack in packs:
                lens = [len(s["input_ids"]) for s in pack]
                grid = [g for s in pack for g in s["grids"]]
                flops.append(
                    {
                        "tokens": sum(lens),
                        "lm": spec.lm_flops(cfg, lens),
                        "vit": spec.vision_flops(cfg, grid) if grid else 0.0,
                    }
                )
            liger = "off"
            if not args.no_liger and device.type == "cuda":
                try:
                    import lmms_kernels

                    lmms_kernels.apply_liger(model, "qwen2_5_vl")
                    liger = "rmsnorm+swiglu"
                except Exception as e:  # reported in the table, the run goes on without it
                    liger = f"failed: {type(e).__name__}"
            blocks = spec.decoder_blocks(model) + spec.vision_blocks(model)
            if ac not in ("none", "full", "selective"):
                from lmms_parallel import apply_activation_checkpointing

                frac = float(ac)
                apply_activation_checkpointing(
                    select_blocks(spec.decoder_blocks(model), frac)
                    + select_blocks(spec.vision_blocks(model), frac),
                    mode="full",
                )
            elif ac != "none":
                from lmms_parallel import apply_activation_checkpointing

                apply_activation_checkpointing(blocks, mode=ac)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
            batches = (pack_batch(spec, model, p, n_tokens, device) for p in packs)

            def step(batch, model=model, opt=opt):
                with autocast:
                    loss_sum, count = spec.packed_forward(model, batch)
                loss = loss_sum / count.clamp(min=1)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            res = run(f"lmms ac={ac}", step, batches, flops, args, device)
            res.update(T=n_tokens, liger=liger, backend=args.backend)
            results.append(res)
            print(json.dumps(res), flush=True)
            del model, opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # ---- plain transformers (same samples), padded batches
        for base in args.baselines:
            import transformers

            if base == "hf-sdpa-liger":
                try:
                    from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

                    apply_liger_kernel_to_qwen2_5_vl(
                        rope=False, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True
                    )
                except Exception as e:
                    res = {
                        "run": base,
                        "status": f"liger failed: {type(e).__name__}",
                        "T": n_tokens,
                    }
                    results.append(res)
                    print(json.dumps(res), flush=True)
                    continue
            hf_cfg = spec.make_config(config)
            hf_cfg._attn_implementation = "sdpa"
            hf_cfg.text_config._attn_implementation = "sdpa"
            hf_cfg.vision_config._attn_implementation = "sdpa"
            with torch.device(device):
                model = transformers.Qwen2_5_VLForConditionalGeneration(hf_cfg).train()
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
            packs = make_samples(
                model.config, n_tokens, n_steps, random.Random(args.seed), args.tiny
            )
            flops = []
            for pack in packs:
                lens = [len(s["input_ids"]) for s in pack]
                grid = [g for s in pack for g in s["grids"]]
                flops.append(
                    {
                        "tokens": sum(lens),
                        "lm": spec.lm_flops(model.config, lens),
                        "vit": spec.vision_flops(model.config, grid) if grid else 0.0,
                    }
                )
            batches = (padded_batches(model, p, n_tokens, device) for p in packs)

            def hf_step(batch, model=model, opt=opt):
                with autocast:
                    out = model(**batch, use_cache=False)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return out.loss.detach()

            res = run(base, hf_step, batches, flops, args, device)
            res.update(T=n_tokens)
            results.append(res)
            print(json.dumps(res), flush=True)
            del model, opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (tiny)"
    print(f"\nQwen2.5-VL-3B-shaped packed training step on {dev_name}; MFU vs 989 TFLOP/s")
    head = f"{'T':>6} {'run':<22} {'status':<8} {'tok/s':>8} {'MFU tot':>8} {'MFU LM':>7} {'ViT%':>5} {'s/step':>7} {'peak GiB':>8}"
    print(head)
    for r in results:
        if r.get("status") != "ok":
            print(f"{r.get('T', ''):>6} {r['run']:<22} {r['status']}")
            continue
        print(
            f"{r['T']:>6} {r['run']:<22} {'ok':<8} {r['tok_s']:>8} {r['mfu_total']:>8.3f} "
            f"{r['mfu_lm']:>7.3f} {100 * r['vit_flop_share']:>5.1f} {r['step_s']:>7.3f} {r['peak_gib']:>8}"
        )
    for n_tokens in args.tokens:
        ok = [r for r in results if r.get("T") == n_tokens and r.get("status") == "ok"]
        best = max(
            (r for r in ok if r["run"].startswith("lmms")), key=lambda r: r["tok_s"], default=None
        )
        base = max(
            (r for r in ok if r["run"].startswith("hf")), key=lambda r: r["tok_s"], default=None
        )
        if best and base:
            print(
                f"T={n_tokens}: lmms best {best['tok_s']} tok/s = {best['tok_s'] / base['tok_s']:.1f}x {base['run']}"
            )
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "bench_packed.json"), "w") as f:
            json.dump(
                {"device": dev_name, "peak_flops": PEAK_FLOPS, "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
