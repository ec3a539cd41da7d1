"""Rotary embedding under compiled decoder blocks: where upstream's layout costs time.

The 2026-12-03 profile of the trainer's compiled Qwen2.5-3B step (benchmarks/RESULTS.md) spent
32 ms per step in three Inductor kernels around the rotary embedding
(``triton_poi_fused_add_cat_mul_neg_slice_transpose_*``): 453 us per layer in forward for about
150 MB of traffic, ~10x what the memory bandwidth allows. Upstream applies the rotation to
``q``/``k`` viewed as ``[B, H, L, D]`` (a transpose of the projection's ``[B, L, H, D]``
output); lmms' varlen attention then wants ``[L, H, D]`` again.

This script times one decoder's blocks (the ``qwen2_5`` 3B shape, ``--layers`` of them) forward
and backward on one packed row through ``spec.packed_forward``, blocks compiled as the trainer
does (``lmms_kernels.compile_blocks``), for each variant:

* ``upstream``: transformers' ``apply_rotary_pos_emb`` as is (what the trainer runs);
* ``lmajor``: the same arithmetic on ``[B, L, H, D]`` (the projection's own layout, cos/sin
  unsqueezed at dim 2), returned as the transposed view upstream expects, so the attention
  function's ``transpose(1, 2).reshape(...)`` is a view;
* ``static``: ``upstream`` compiled with static shapes (dynamic=False), to separate the layout
  from the dynamic-shape index arithmetic.

Per variant: mean fwd+bwd time over ``--iters`` (after ``--warmup``), and from one profiled
iteration the device time of the rotary kernels (Inductor kernel names with ``cat``, ``neg``
and ``mul``: rotate_half's pattern) and of all kernels. On CUDA the generated source of the
rotary kernels is copied to ``$OUT`` (``rope_<variant>_<n>.py``) for reading.

GPU:  python3 benchmarks/models/bench_rope.py --tokens 16384 --layers 4
CPU:  python benchmarks/models/bench_rope.py --tiny   (plumbing only, aot_eager)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import lmms_kernels
from lmms_models import get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples


def lmajor_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """Upstream's rotation computed on ``[B, L, H, D]`` (``q``/``k`` arrive as the transposed
    view ``[B, H, L, D]`` of that layout) and handed back as the same transposed view."""

    def rotate(x):  # [B, L, H, D]
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, L, 1, D]
    ql, kl = q.transpose(1, 2), k.transpose(1, 2)
    return (ql * c + rotate(ql) * s).transpose(1, 2), (kl * c + rotate(kl) * s).transpose(1, 2)


def is_rope_kernel(name: str) -> bool:
    return all(p in name for p in ("cat", "neg", "mul"))


def run_variant(variant: str, args: argparse.Namespace, device: torch.device) -> dict:
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    original = qwen2.apply_rotary_pos_emb
    if variant == "lmajor":
        qwen2.apply_rotary_pos_emb = lmajor_rotary
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        spec = get_model_spec("qwen2_5")
        if args.tiny:
            config = spec.tiny_config(num_hidden_layers=args.layers)
        else:
            config = {**spec.presets["3b"], "num_hidden_layers": args.layers}
        dtype = torch.float32 if args.tiny else torch.bfloat16
        backend = "varlen_sdpa" if args.tiny else "auto"
        model = spec.build(config=config, device=device, dtype=dtype, attn_backend=backend)
        lmms_kernels.compile_blocks(
            spec.decoder_blocks(model),
            backend="aot_eager" if args.tiny else "inductor",
            dynamic=variant != "static",
        )
        gen = torch.Generator().manual_seed(0)
        n = max(1, args.tokens // args.segment)
        samples = [
            make_sample(spec, model.config, SampleSpec(text=args.segment), gen=gen)
            for _ in range(n)
        ]
        batch = pack_samples(spec, model, samples)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

        def step():
            model.zero_grad(set_to_none=True)
            loss, _ = spec.packed_forward(model, batch)
            loss.backward()
            return loss.detach()

        t0 = time.perf_counter()
        first_loss = float(step())  # same weights and row in every variant: equal up to rounding
        first_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        sync()
        step_ms = (time.perf_counter() - t0) / args.iters * 1e3

        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            sync()
        rope_us = total_us = 0.0
        names = set()
        for ev in prof.key_averages():
            us = ev.self_device_time_total if device.type == "cuda" else 0.0
            if ev.device_type == torch.autograd.DeviceType.CUDA or device.type != "cuda":
                total_us += us
            if is_rope_kernel(ev.key) and not ev.key.startswith("aten"):
                rope_us += us
                names.add(ev.key)
        return {
            "variant": variant,
            "tokens": batch["input_ids"].numel(),
            "layers": args.layers,
            "first_loss": round(first_loss, 5),
            "first_step_s": round(first_s, 1),
            "step_ms": round(step_ms, 2),
            "rope_kernels_ms": round(rope_us / 1e3, 2),
            "all_kernels_ms": round(total_us / 1e3, 2),
            "rope_kernels": sorted(names),
        }
    finally:
        qwen2.apply_rotary_pos_emb = original


def copy_kernel_sources(variant: str, since: float, out: Path) -> list[str]:
    """The generated sources of rotary kernels written since ``since`` (Inductor's cache)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    found = []
    for path in Path(cache_dir()).rglob("*.py"):
        if path.stat().st_mtime < since:
            continue
        text = path.read_text(errors="ignore")
        heads = [line for line in text.splitlines() if line.startswith("def triton_")]
        if any(is_rope_kernel(line) for line in heads):
            found.append(path)
    copied = []
    for i, path in enumerate(sorted(found)[:3]):
        dest = out / f"rope_{variant}_{i}.py"
        dest.write_text(path.read_text())
        copied.append(dest.name)
    return copied


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--segment", type=int, default=2048, help="tokens per packed sample")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=["upstream", "lmajor", "static"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="CPU plumbing check (aot_eager)")
    args = p.parse_args()
    if args.tiny:
        args.tokens, args.segment, args.layers, args.warmup, args.iters = 64, 16, 2, 1, 2
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    out = Path(os.environ.get("OUT", "."))
    rows = []
    for variant in args.variants:
        since = time.time()
        try:
            row = run_variant(variant, args, device)
        except Exception as exc:  # report it and go on with the next variant
            row = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"[:400]}
        if device.type == "cuda" and "error" not in row:
            row["sources"] = copy_kernel_sources(variant, since, out)
        print(json.dumps(row), flush=True)
        rows.append(row)
    (out / "bench_rope.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
