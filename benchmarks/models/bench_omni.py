"""Packed training step of a Qwen2.5-Omni-3B-shaped thinker on an audio + image + text mix vs the
upstream model's own unpacked forward (issue 26's benchmark).

One process, one GPU, random weights of the published 3B thinker shape (``qwen2_5_omni`` preset
``3b``: ViT, audio encoder, Qwen2.5-3B decoder). Synthetic samples drawn once and used by every
configuration: ~40% carry one 224-448 px image, ~40% one 2-20 s audio clip, ~20% both, long-tailed
(log-normal) text around them (``lmms_models.testing_audio.make_omni_sample``'s layout: TMRoPE
positions from upstream's ``get_rope_index``).

* ``lmms``: samples packed into rows of ``--tokens`` tokens, ``spec.packed_forward`` (lmms varlen
  attention in the decoder, the ViT and the audio encoder; host merge; fused linear CE), decoder
  and tower blocks checkpointed (``--ac``), bf16 weights through FSDP2 on a 1-rank mesh
  (fp32 masters, as the trainer on one GPU with ``fsdp: true``), fused AdamW.
* ``hf``: the upstream thinker, ``model(..., labels=...)`` per sample (SDPA, gradient
  checkpointing, bf16 autocast over fp32 weights), gradient accumulation over the same samples,
  one optimizer step per pack. Liger has no Qwen2.5-Omni patch; ``--hf-liger`` applies its
  RMSNorm/SwiGLU/fused-CE modules through ``lmms_kernels.apply_liger`` when the family is known
  to it (else the row says so).

MFU = FLOPs / time / 989e12 (dense bf16 datasheet peak of H100/H200): the decoder's
``6N + 12·L·h·Σs²`` (full-matrix attention convention; recompute not counted) plus, for the total,
the ViT (``vision_flops``) and the audio encoder (``omni_audio_flops``): ``spec.media_flops``.
``--tiny``: the tiny config on CPU (plumbing check, seconds). Rows go to ``$OUT/bench_omni.json``
and, with ``--write``, to benchmarks/RESULTS.md.

GPU: python3 benchmarks/models/bench_omni.py --tokens 16384 --steps 8 --write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness

from lmms_models import get_model_spec
from lmms_models.testing_audio import OmniSampleSpec, make_omni_sample, pack_audio_samples

PEAK_FLOPS = 989e12


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (plumbing check)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per packed row")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="auto", help="lmms varlen attention backend")
    p.add_argument("--ac", default="full", choices=["none", "full"], help="lmms checkpointing")
    p.add_argument("--no-hf", action="store_true", help="skip the upstream baseline")
    p.add_argument("--hf-liger", action="store_true", help="baseline with lmms_kernels.apply_liger")
    p.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    return p.parse_args()


def draw_specs(n: int, *, tiny: bool, seed: int = 0) -> list[OmniSampleSpec]:
    """Sample shapes: images as patch grids (14 px patches, merge 2), audio as mel frames."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u = float(torch.rand((), generator=g))
        text = int(
            torch.distributions.LogNormal(5.0 if not tiny else 2.0, 0.8).sample().clamp(4, 3000)
        )
        side = (lambda: 4) if tiny else (lambda: 2 * int(torch.randint(8, 17, (), generator=g)))
        frames = (lambda: 60) if tiny else (lambda: int(torch.randint(200, 2001, (), generator=g)))
        images = [(1, side(), side())] if u < 0.6 else []
        audios = [frames()] if u > 0.4 else []
        out.append(OmniSampleSpec(text=text, images=images, audios=audios, prompt=4))
    return out


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit rows of sample indices (a sample longer than the budget is dropped)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > budget:
            continue
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(budget - n)
    return rows


def to(batch: dict[str, Any], device: torch.device, host: tuple[str, ...]) -> dict[str, Any]:
    return {
        k: v.to(device) if torch.is_tensor(v) and k not in host else v for k, v in batch.items()
    }


def run_lmms(spec, conf, rows, device, args) -> dict[str, Any]:
    """FSDP2 on a 1-rank mesh (bf16 compute, fp32 masters) with the trainer's units; the root's
    forward is the packed loss, so FSDP's root hooks run around ``packed_forward``."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh

    from lmms_parallel import apply_activation_checkpointing, apply_fsdp

    torch.manual_seed(0)
    model = spec.build(config=conf, device=device, attn_backend=args.backend)
    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model)
    apply_activation_checkpointing(blocks, args.ac)
    model.forward = functools.partial(spec.packed_forward, model)
    mesh = init_device_mesh(device.type, (1,))
    apply_fsdp(model, mesh, blocks=blocks + spec.embeddings(model), param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step(batch):
        loss, n = model(to(batch, device, spec.host_keys))
        (loss / n.clamp(min=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, rows, args, device)


def run_hf(spec, conf, samples_per_row, device, args) -> dict[str, Any]:
    torch.manual_seed(0)
    model = spec.build(config=conf, device=device, attn_backend="sdpa")
    model.gradient_checkpointing_enable()
    handle = None
    if args.hf_liger:
        from lmms_kernels import apply_liger

        handle = apply_liger(model, spec.liger_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def step(samples):
        for s in samples:
            kwargs = {k: to({k: v}, device, ())[k] for k, v in s["ref_kwargs"].items()}
            with autocast:
                out = model(input_ids=s["input_ids"][None].to(device), labels=s["labels"][None].to(device),
                            use_cache=False, **kwargs)  # fmt: skip
            (out.loss / len(samples)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        return timed(step, samples_per_row, args, device)
    finally:
        if handle is not None:
            handle.remove()


def timed(step, items, args, device) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args.warmup):
        step(items[i % len(items)])
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(items[(args.warmup + i) % len(items)])
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return {"step_s": dt, "peak_gib": mem}


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not torch.distributed.is_initialized():  # FSDP2's 1-rank mesh
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    spec = get_model_spec("qwen2_5_omni")
    conf = spec.tiny_config() if args.tiny else spec.preset("3b")
    ref = spec.build(config=conf, device="meta")
    budget = args.tokens if not args.tiny else 256
    specs = draw_specs(400 if not args.tiny else 24, tiny=args.tiny)
    gen = torch.Generator().manual_seed(1)
    samples = [make_omni_sample(spec, ref.config, s, gen=gen) for s in specs]
    rows_idx = pack_rows([s["input_ids"].numel() for s in samples], budget)
    needed = args.warmup + args.steps
    rows_idx = (rows_idx * (needed // max(1, len(rows_idx)) + 1))[:needed]
    # positions need a model instance for get_rope_index: a tiny one computes the same indices
    pos_model = spec.build(
        config=spec.tiny_config(**{k: conf[k] for k in conf if k.endswith("_id")}), device="cpu"
    )
    batches = [pack_audio_samples(spec, pos_model, [samples[i] for i in r]) for r in rows_idx]
    tokens = [int(b["input_ids"].numel()) for b in batches]
    lens = [(b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).tolist() for b in batches]
    lm = sum(spec.lm_flops(ref.config, x) for x in lens) / len(batches)
    media = sum(spec.media_flops(ref.config, b) for b in batches) / len(batches)
    per_row = sum(tokens) / len(tokens)
    results = []
    for name, fn, arg in (("lmms", run_lmms, batches),
                          ("hf-sdpa" + ("-liger" if args.hf_liger else ""), run_hf,
                           [[samples[i] for i in r] for r in rows_idx])):  # fmt: skip
        if name.startswith("hf") and args.no_hf:
            continue
        try:
            r = fn(spec, conf, arg, device, args)
            r.update(name=name, tokens_per_s=per_row / r["step_s"],
                     mfu=(lm + media) / r["step_s"] / PEAK_FLOPS, mfu_lm=lm / r["step_s"] / PEAK_FLOPS)  # fmt: skip
        except Exception as exc:  # an OOM or error is a row, not the end of the run
            traceback.print_exc()
            r = {"name": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        results.append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    header = ["config", "tokens/s", "MFU total", "MFU LM", "step s", "peak GiB"]
    table = harness.markdown_table(header, [
        [r["name"], *(("error: " + r["error"], "", "", "", "") if "error" in r else
                      (f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%", f"{100 * r['mfu_lm']:.1f}%",
                       f"{r['step_s']:.3f}", f"{r['peak_gib']:.1f}"))]
        for r in results
    ])  # fmt: skip
    print(table)
    out = Path(os.environ.get("OUT", "."))
    (out / "bench_omni.json").write_text(json.dumps(results, indent=1))
    if args.write and not args.tiny:
        note = (f"{per_row:.0f} real tokens per row; media FLOPs {100 * media / (lm + media):.0f}% "
                "of the total")  # fmt: skip
        harness.write_section("Qwen2.5-Omni-3B thinker: packed audio + image + text step",
                              table + "\n\n" + note, command=" ".join(["python3", *sys.argv]))  # fmt: skip


if __name__ == "__main__":
    main()
