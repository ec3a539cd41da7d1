"""Packed (rmpad) training step of a Qwen2.5-VL-3B-shaped model vs plain transformers.

One process, one GPU, random weights with the real architecture (``qwen2_5_vl`` preset ``3b``).
Synthetic image+text samples: 224-672 px images (0-2 per sample, ~20% text-only), long-tailed
(log-normal) text lengths. Every configuration trains on the *same* samples:

* ``lmms`` variants: samples packed into rows of ``T`` tokens; ``spec.packed_forward`` (lmms
  varlen attention for the LM and the vision tower, fused linear CE), Liger RMSNorm/SwiGLU
  through ``lmms_kernels.apply_liger`` when available. Each variant (``--variants``) is
  ``AC[/fsdp][/keep][/compile][/noalign]``:

  - ``AC``: activation checkpointing of the decoder and vision blocks: ``none``, ``full``,
    ``sel`` (lmms_parallel's op-level selective mode: matmul and SDPA outputs saved,
    element-wise ops recomputed) or a fraction of blocks fully checkpointed (``0.5``: every
    other block), all through ``lmms_parallel.apply_activation_checkpointing`` as the trainer;
    ``LM:VIT`` sets the towers apart (``0.5:none``: half the decoder blocks, no ViT block).
  - ``fsdp``: bf16 compute without autocast: FSDP2 ``fully_shard`` on a 1-rank mesh with
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 master weights cast to
    bf16 once per block and step; bf16 residual stream and saved activations). Without it:
    fp32 weights under bf16 autocast (per-op casts, fp32 residual stream).
  - ``keep`` (with ``fsdp``): ``reshard_after_forward=False`` (the trainer's
    ``trainer_args.reshard_after_forward``): each block's bf16 weights stay gathered from its
    forward to its backward. On one rank resharding frees nothing worth having (the bf16 copy of
    the model, 7 GiB) and costs a second cast-and-copy of every weight in backward.
  - ``compile``: ``lmms_kernels.compile_blocks`` on every decoder and vision block, the
    trainer's ``trainer_args.compile``: ``torch.compile(dynamic=True)`` of each block's forward
    after its checkpoint wrapper (the checkpoint sits inside the graph) and before FSDP;
    attention is a custom op (no graph break), Liger's ops give way to Inductor's fusion.
  - ``noalign``: Liger's SwiGLU without padding the ViT MLP's 3420 width to 3424
    (``apply_liger(align_mlp=False)``), the aligned-MLP lever's "before".
* ``hf-sdpa`` / ``hf-sdpa-liger``: plain transformers, ``model(..., labels=...)`` with SDPA and
  gradient checkpointing, the same samples in padded micro-batches of at most
  ``--hf-micro-tokens`` padded tokens (gradient accumulation, one optimizer step per pack); the
  second with liger-kernel's own ``apply_liger_kernel_to_qwen2_5_vl`` (RMSNorm, SwiGLU, fused
  linear CE; patches the classes globally, so baselines run after all lmms variants).

All: fp32 master weights, fused AdamW. Tokens/s counts real (unpadded) tokens.
MFU = FLOPs / time / 989e12 (H100/H200 dense bf16 datasheet peak): LM ``6N + 12·L·h·s`` per token
(full-attention convention of the calibration; recompute not counted), ViT from the image grids
(lmms_models' ``vision_flops``). A failing variant (OOM, error) is reported and the run goes on.
The table comes last; ``$OUT/bench_packed.json`` gets the rows. ``--tiny``: CPU plumbing check.

GPU: python3 benchmarks/models/bench_packed.py --tokens 16384 32768 \\
         --variants full full/fsdp 0.5/fsdp/compile --baselines hf-sdpa-liger
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import lmms_kernels
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
        "--variants",
        nargs="+",
        default=["full"],
        help="lmms variants AC[/fsdp][/compile], AC in none|full|sel|<fraction>; e.g. "
        "full full/fsdp 0.5/fsdp/compile",
    )
    p.add_argument(
        "--variant-tokens",
        nargs="*",
        default=[],
        help="restrict a variant to some T: VARIANT@T (e.g. 0.25/fsdp@16384); others run at all T",
    )
    p.add_argument("--no-liger", action="store_true", help="lmms without Liger RMSNorm/SwiGLU")
    p.add_argument(
        "--baselines",
        nargs="*",
        default=["hf-sdpa", "hf-sdpa-liger"],
        help="plain transformers runs (after all lmms variants)",
    )
    p.add_argument(
        "--baseline-tokens", type=int, nargs="*", help="T for the baselines (default: first T)"
    )
    p.add_argument("--hf-micro-tokens", type=int, default=4096, help="padded tokens/micro-batch")
    p.add_argument("--hf-steps", type=int, default=2, help="timed steps of the baselines")
    p.add_argument("--hf-warmup", type=int, default=1)
    p.add_argument(
        "--max-variant-s", type=float, default=150.0, help="stop a variant's steps after this"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one extra step per lmms run; top CUDA kernels to $OUT/profile_<run>.txt",
    )
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
    # as the trainer does: the spec's host_keys (Qwen2.5-VL's grids) stay on the host
    keep = spec.host_keys
    return {
        k: v.to(device) if torch.is_tensor(v) and k not in keep else v for k, v in batch.items()
    }


def micro_batches(pack, max_padded: int) -> list[list[dict]]:
    """Split one pack's samples (longest first) into micro-batches of at most ``max_padded``
    padded tokens (rows x longest row), so plain transformers fits in memory."""
    groups: list[list[dict]] = []
    for s in sorted(pack, key=lambda s: -len(s["input_ids"])):
        if groups and len(groups[-1][0]["input_ids"]) * (len(groups[-1]) + 1) <= max_padded:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def padded_batch(model, pack, device):
    """A plain-transformers batch of ``pack``'s samples: rows padded to the longest."""
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


# ----------------------------------------------------------------------------- variants
def parse_variant(text: str) -> dict[str, Any]:
    """``AC[/fsdp][/keep][/compile][/noalign]`` -> {"ac_lm", "ac_vit", "fsdp", "keep", "compile",
    "align"};
    ``AC`` is one mode for both towers or ``LM:VIT`` (e.g. ``0.5:none``); ``noalign`` runs the
    Liger SwiGLU without padding the ViT MLP's 3420 width to 3424 (the lever's "before")."""
    ac, *flags = text.split("/")
    unknown = set(flags) - {"fsdp", "keep", "compile", "noalign"}
    if unknown:
        raise ValueError(
            f"variant {text!r}: unknown flags {sorted(unknown)} (fsdp, keep, compile, noalign)"
        )
    if "keep" in flags and "fsdp" not in flags:
        raise ValueError(f"variant {text!r}: keep (no reshard after forward) needs fsdp")
    ac_lm, _, ac_vit = ac.partition(":")
    ac_vit = ac_vit or ac_lm
    for mode in (ac_lm, ac_vit):
        if mode not in ("none", "full", "sel") and not 0.0 <= float(mode) <= 1.0:
            raise ValueError(f"variant {text!r}: AC fraction must be in [0, 1]")
        if mode == "sel" and "compile" in flags:
            raise NotImplementedError(
                "sel/compile: op-level selective checkpointing under compile is not measured "
                "here; use a block fraction with compile"
            )
    return {
        "ac_lm": ac_lm,
        "ac_vit": ac_vit,
        "fsdp": "fsdp" in flags,
        "keep": "keep" in flags,
        "compile": "compile" in flags,
        "align": "noalign" not in flags,
    }


def wrap_blocks(blocks, *, ac: str, compile_blocks: bool, backend: str = "inductor") -> None:
    """What the trainer does to a tower's blocks: checkpoint the chosen ones
    (``lmms_parallel.apply_activation_checkpointing``, fraction spread evenly), then
    ``torch.compile`` them (``lmms_kernels.compile_blocks``): AC, compile, then FSDP
    (torchtitan's order; ``shard_bf16`` runs after this)."""
    from lmms_parallel import apply_activation_checkpointing

    if ac in ("none", "full", "sel"):
        mode, fraction = {"sel": "selective"}.get(ac, ac), 1.0
    else:
        mode, fraction = "full", float(ac)
    apply_activation_checkpointing(blocks, mode, fraction=fraction)
    if compile_blocks:
        lmms_kernels.compile_blocks(blocks, backend=backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_bf16(spec, model, device, *, keep: bool = False) -> None:
    """FSDP2 on a 1-rank mesh for bf16 compute from fp32 master weights (no autocast), through
    ``lmms_parallel.apply_fsdp`` with the trainer's units (vision blocks, decoder blocks,
    embeddings, root). The root's forward is the packed loss, so FSDP's root hooks (unshard,
    post-backward gradient reduction) run around ``packed_forward``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lmms_parallel import apply_fsdp

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model) + spec.embeddings(model)
    model.forward = functools.partial(spec.packed_forward, model)
    mesh = init_device_mesh(device.type, (1,))
    apply_fsdp(model, mesh, blocks=blocks, reshard_after_forward=not keep)


# ----------------------------------------------------------------------------- runs
def run(name, step_fn, batches, flops, warmup: int, device, max_s: float) -> dict[str, Any]:
    """Time ``step_fn`` over ``batches`` (``warmup`` first); errors are results, not crashes.
    Past ``max_s`` seconds after the first step (e.g. a compile that recompiles every step) the
    run stops and reports the steps timed so far."""
    times: list[float] = []
    graphs_before_timed = 0
    start = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = None
    try:
        batch = None
        for i, batch in enumerate(batches):
            if cuda:
                torch.cuda.synchronize()
            if i == warmup:
                graphs_before_timed = lmms_kernels.compile_counts()["graphs"]
            t0 = time.perf_counter()
            loss = step_fn(batch)
            if cuda:
                torch.cuda.synchronize()
            if i == 0:  # compilation and autotuning happen here: not counted against max_s
                first = time.perf_counter() - t0
                start = time.perf_counter()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if time.perf_counter() - start > max_s and i + 1 < len(flops):
                print(f"{name}: stopped after {i + 1} steps (--max-variant-s {max_s})")
                break
    except torch.OutOfMemoryError:
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else 0.0
        return {"run": name, "status": "OOM", "peak_gib": peak}
    except Exception as e:  # a broken variant must not cost the other variants
        traceback.print_exc()
        return {"run": name, "status": f"error: {type(e).__name__}: {str(e)[:200]}"}
    if PROFILE and cuda and times:
        profile_step(name, step_fn, batch)
    n_timed = len(times)
    if not n_timed:
        return {"run": name, "status": f"too slow: first step {first:.0f} s"}
    timed = slice(warmup, warmup + n_timed)
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
        "step_s_max": round(max(times), 3),
        # graphs dynamo compiled during the timed steps: recompiles there (0 for eager runs)
        "timed_new_graphs": lmms_kernels.compile_counts()["graphs"] - graphs_before_timed,
        "first_step_s": round(first, 1) if first is not None else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else 0.0,
        "loss": round(float(loss), 4),
        "timed_steps": n_timed,
    }


PROFILE = False


def profile_step(name: str, step_fn, batch) -> None:
    """One more step under torch.profiler; its kernels by CUDA time go to $OUT (or stdout)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn(batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90
    )
    safe = "".join(ch if ch.isalnum() else "_" for ch in name)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"profile_{safe}.txt").write_text(table)
    else:
        print(table)


def step_flops(spec, cfg, packs) -> list[dict[str, float]]:
    out = []
    for pack in packs:
        lens = [len(s["input_ids"]) for s in pack]
        grid = [g for s in pack for g in s["grids"]]
        out.append(
            {
                "tokens": sum(lens),
                "lm": spec.lm_flops(cfg, lens),
                "vit": spec.vision_flops(cfg, grid) if grid else 0.0,
            }
        )
    return out


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_lmms(spec, config, variant: str, n_tokens: int, args, device) -> dict[str, Any]:
    """Build, wrap and time one lmms variant."""
    v = parse_variant(variant)
    torch.manual_seed(args.seed)
    model = spec.build(config=config, device=device, attn_backend=args.backend).train()
    cfg = model.config
    packs = make_samples(
        cfg, n_tokens, args.warmup + args.steps, random.Random(args.seed), args.tiny
    )
    flops = step_flops(spec, cfg, packs)
    liger = "off"
    if not args.no_liger and device.type == "cuda":
        try:
            lmms_kernels.apply_liger(model, spec.liger_plan, align_mlp=v["align"])
            liger = "rmsnorm+swiglu" + ("" if v["align"] else " (unaligned MLP)")
        except Exception as e:  # reported in the table, the run goes on without it
            liger = f"failed: {type(e).__name__}"
    # --tiny (CPU plumbing): dynamo + AOTAutograd without Inductor, whose CPU code generation
    # takes minutes; the GPU run compiles with Inductor, as trainer_args.compile does
    cb = "aot_eager" if args.tiny else "inductor"
    wrap_blocks(spec.decoder_blocks(model), ac=v["ac_lm"], compile_blocks=v["compile"], backend=cb)
    wrap_blocks(spec.vision_blocks(model), ac=v["ac_vit"], compile_blocks=v["compile"], backend=cb)
    if v["fsdp"]:
        shard_bf16(spec, model, device, keep=v["keep"])
        autocast = torch.autocast(device.type, enabled=False)
    else:
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    batches = (pack_batch(spec, model, p, n_tokens, device) for p in packs)

    def step(batch):
        with autocast:
            loss_sum, count = model(batch) if v["fsdp"] else spec.packed_forward(model, batch)
        loss = loss_sum / count.clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    before = lmms_kernels.compile_counts() if v["compile"] else None
    res = run(f"lmms {variant}", step, batches, flops, args.warmup, device, args.max_variant_s)
    if before is not None:
        after = lmms_kernels.compile_counts()
        res.update({k: after[k] - before[k] for k in after})
    res.update(T=n_tokens, liger=liger, backend=args.backend)
    return res


def run_baseline(spec, config, base: str, n_tokens: int, args, device) -> dict[str, Any]:
    """Plain transformers on the same samples, padded micro-batches, gradient accumulation."""
    import transformers

    if base == "hf-sdpa-liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

            apply_liger_kernel_to_qwen2_5_vl(
                rope=False, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True
            )
        except Exception as e:
            return {"run": base, "status": f"liger failed: {type(e).__name__}", "T": n_tokens}
    torch.manual_seed(args.seed)
    hf_cfg = spec.make_config(config)
    for c in (hf_cfg, hf_cfg.text_config, hf_cfg.vision_config):
        c._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration(hf_cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    n_steps = args.hf_warmup + args.hf_steps
    packs = make_samples(model.config, n_tokens, n_steps, random.Random(args.seed), args.tiny)
    flops = step_flops(spec, model.config, packs)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def hf_step(pack):
        n_total = sum(len(s["input_ids"]) for s in pack)
        total = torch.zeros((), device=device)
        for group in micro_batches(pack, args.hf_micro_tokens):
            batch = padded_batch(model, group, device)
            with autocast:
                out = model(**batch, use_cache=False)
            w = sum(len(s["input_ids"]) for s in group) / n_total
            (out.loss * w).backward()
            total += out.loss.detach() * w
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    res = run(base, hf_step, packs, flops, args.hf_warmup, device, args.max_variant_s)
    res.update(T=n_tokens, micro_tokens=args.hf_micro_tokens)
    return res


def print_table(results, dev_name: str, tokens) -> None:
    print(f"\nQwen2.5-VL-3B-shaped packed training step on {dev_name}; MFU vs 989 TFLOP/s")
    head = (
        f"{'T':>6} {'run':<28} {'status':<8} {'tok/s':>8} {'MFU tot':>8} {'MFU LM':>7} "
        f"{'ViT%':>5} {'s/step':>7} {'1st s':>6} {'peak GiB':>8}"
    )
    print(head)
    for r in results:
        if r.get("status") != "ok":
            print(f"{r.get('T', ''):>6} {r['run']:<28} {r['status']}")
            continue
        print(
            f"{r['T']:>6} {r['run']:<28} {'ok':<8} {r['tok_s']:>8} {r['mfu_total']:>8.3f} "
            f"{r['mfu_lm']:>7.3f} {100 * r['vit_flop_share']:>5.1f} {r['step_s']:>7.3f} "
            f"{r['first_step_s']:>6} {r['peak_gib']:>8}"
        )
    ok = [r for r in results if r.get("status") == "ok"]
    base = max((r for r in ok if r["run"].startswith("hf")), key=lambda r: r["tok_s"], default=None)
    for n_tokens in tokens:
        best = max(
            (r for r in ok if r["run"].startswith("lmms") and r["T"] == n_tokens),
            key=lambda r: r["tok_s"],
            default=None,
        )
        if best and base:
            ratio = best["tok_s"] / base["tok_s"]
            print(
                f"T={n_tokens}: lmms best ({best['run']}) {best['tok_s']} tok/s, "
                f"{best['mfu_total']:.3f} MFU = {ratio:.1f}x {base['run']} (T={base['T']})"
            )


def main() -> None:
    args = parse_args()
    global PROFILE
    PROFILE = args.profile
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        args.tokens = sorted({min(t, 256) for t in args.tokens})
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.hf_steps, args.hf_warmup = min(args.hf_steps, 1), min(args.hf_warmup, 1)
        args.hf_micro_tokens = min(args.hf_micro_tokens, 128)
        torch.set_num_threads(1)
    for variant in args.variants:
        parse_variant(variant)  # fail fast on a typo, before any model is built
    only: dict[str, set[int]] = {}
    for item in args.variant_tokens:
        name, t = item.rsplit("@", 1)
        only.setdefault(name, set()).add(min(int(t), 256) if args.tiny else int(t))
    spec = get_model_spec("qwen2_5_vl")
    config = spec.tiny_config() if args.tiny else spec.preset("3b")
    results: list[dict[str, Any]] = []
    for n_tokens in args.tokens:
        for variant in args.variants:
            if variant in only and n_tokens not in only[variant]:
                continue
            res = run_lmms(spec, config, variant, n_tokens, args, device)
            free(device)  # the variant's model and optimizer died with run_lmms' frame
            results.append(res)
            print(json.dumps(res), flush=True)
    base_tokens = args.baseline_tokens or args.tokens[:1]
    if args.tiny:
        base_tokens = [min(t, 256) for t in base_tokens]
    for n_tokens in base_tokens:
        for base in args.baselines:
            res = run_baseline(spec, config, base, n_tokens, args, device)
            free(device)
            results.append(res)
            print(json.dumps(res), flush=True)
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (tiny)"
    print_table(results, dev_name, args.tokens)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "bench_packed.json"), "w") as f:
            json.dump(
                {
                    "device": dev_name,
                    "peak_flops": PEAK_FLOPS,
                    "args": vars(args),
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
