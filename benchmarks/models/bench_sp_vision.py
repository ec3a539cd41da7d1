"""Vision work under Ulysses SP: every rank encoding the whole pack (``repeated``, the baseline)
vs each rank encoding its FLOPs-balanced share with the features all-gathered (``split``,
``lmms_parallel.SplitVision``), on a video pack, for SP degrees 2 and 4.

Each (mode, SP) runs in a fresh process group (gloo on CPU, NCCL with ``--device cuda``: one GPU
per rank), so each peak-memory figure is that layout's own. Every rank builds the same random
model (no FSDP: the tower's own cost is what moves), installs Ulysses SP on the text decoder and
runs ``--steps`` timed forward+backward steps of the same packed row after one warm-up step.
Reported per layout (max over ranks): step time, the vision tower's forward time (pre-hook to
post-hook of the tower call, the gather included), the vision FLOPs this rank ran, and the peak
memory (CPU: the process's max RSS; CUDA: ``max_memory_allocated``).

Model: ``--family qwen2_5_vl`` with ``--preset`` (e.g. ``3b`` on GPUs) or, by default, a small
CPU shape (vision depth 8, width 256; text 2 layers, width 256); or ``--family llava_onevision``
(``--preset 0.5b``/``7b``, default tiny-scaled). Pack: ``--videos`` videos of ``--frames`` frames
at ``--size`` px plus ``--text`` text tokens.

CPU: uv run --all-packages --all-extras python benchmarks/models/bench_sp_vision.py --write
GPU (2 ranks): python benchmarks/models/bench_sp_vision.py --device cuda --sp 2 --preset 3b \\
                   --frames 64 --size 448 --videos 4 --write
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness

_SMALL_QWEN = {
    "text_config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": [16, 8, 8]}},
    "vision_config": {"depth": 8, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                      "out_hidden_size": 256, "patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [3, 7]},
}  # fmt: skip
_SMALL_LLAVA = {
    "text_config": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                    "num_key_value_heads": 4},
    "vision_config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
                      "num_attention_heads": 4, "image_size": 224, "patch_size": 14},
}  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "llava_onevision"])
    p.add_argument("--preset", default=None, help="real-size preset (default: a small CPU shape)")
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["repeated", "split"])
    p.add_argument("--videos", type=int, default=2)
    p.add_argument("--frames", type=int, default=16, help="frames per video")
    p.add_argument("--size", type=int, default=224, help="frame side in px")
    p.add_argument("--text", type=int, default=256, help="text tokens in the pack")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default=None, help="varlen attention backend (cpu: varlen_sdpa)")
    p.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    return p.parse_args()


def _model_and_batch(args: argparse.Namespace, device: Any) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    from lmms_models import get_model_spec
    from lmms_models.testing import SampleSpec, make_sample, pack_samples

    spec = get_model_spec(args.family)
    small = _SMALL_QWEN if args.family == "qwen2_5_vl" else _SMALL_LLAVA
    config = spec.preset(args.preset) if args.preset else spec.tiny_config(**small)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("varlen_sdpa" if device.type == "cpu" else "auto")
    model = spec.build(config=config, device=device, dtype=dtype, attn_backend=backend).train()
    gen = torch.Generator().manual_seed(1)
    if args.family == "qwen2_5_vl":
        side = args.size // model.config.vision_config.patch_size // 2 * 2
        videos = [(args.frames // 2, side, side)] * args.videos  # temporal patches of 2 frames
    else:
        videos = [(args.frames, 0, 0)] * args.videos  # frames at the tower's view size
    samples = [make_sample(spec, model.config, SampleSpec(text=args.text, videos=[v]), gen=gen)
               for v in videos]  # fmt: skip
    batch = pack_samples(spec, model, samples)
    for key in ("pixel_values", "pixel_values_videos"):
        if key in batch:
            batch[key] = batch[key].to(device, dtype)
    return spec, model, batch


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out: str):
    import torch
    import torch.distributed as dist

    import lmms_parallel as lp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank,
                            world_size=world)  # fmt: skip
    group = dist.group.WORLD
    spec, model, batch = _model_and_batch(args, device)
    spec.set_attention(model, backend=args.backend or ("varlen_sdpa" if args.device == "cpu"
                       else "auto"), wrapper=lp.UlyssesAttention(group))  # fmt: skip
    tower = spec.vision_tower(model)
    plan = functools.partial(spec.vision_split_plan, model)
    split = lp.SplitVision(tower, plan, group if mode == "split" else None)
    starts: list[float] = []
    spent = [0.0]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def pre(*_a: Any, **_k: Any) -> None:
        sync()
        starts.append(time.perf_counter())

    def post(*_a: Any) -> None:
        sync()
        spent[0] += time.perf_counter() - starts.pop()

    # around SplitVision's own hooks: the split call and the gather are both inside
    handles = [tower.register_forward_pre_hook(pre, prepend=True),
               tower.register_forward_hook(post)]  # fmt: skip
    times, vision = [], []
    with split, lp.SequenceParallel(spec.sp_slice_module(model), group):
        for step in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            spent[0] = 0.0
            sync()
            t0 = time.perf_counter()
            loss, n = spec.packed_forward(model, batch, sp_group=group)
            (loss / n).backward()
            sync()
            if step:  # the first step warms up
                times.append(time.perf_counter() - t0)
                vision.append(spent[0])
    for h in handles:
        h.remove()
    costs = split.last_costs or [float(spec.pack_vision_flops(model.config, batch))] * world
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [min(times), min(vision), peak])
    if rank == 0:
        worst = [max(g[i] for g in gathered) for i in range(3)]
        row = {
            "mode": mode, "sp": world, "step_s": worst[0], "vision_fwd_s": worst[1],
            "peak_gib": worst[2], "vision_tokens": int(batch["mm_token_type_ids"].ne(0).sum()),
            "tokens": int(batch["input_ids"].numel()),
            "vision_tflop_rank_max": max(costs) / 1e12,
            "vision_tflop_total": float(spec.pack_vision_flops(model.config, batch)) / 1e12,
        }  # fmt: skip
        Path(out).write_text(json.dumps(row))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    args = parse()
    rows = []
    for sp in args.sp:
        for mode in args.modes:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            mp.spawn(_worker, args=(sp, _port(), args, mode, out), nprocs=sp, join=True)
            rows.append(json.loads(Path(out).read_text()))
            os.unlink(out)
            print(rows[-1], flush=True)
    for r in rows:
        base = next(b for b in rows if b["sp"] == r["sp"] and b["mode"] == "repeated")
        r["vision_speedup"] = base["vision_fwd_s"] / r["vision_fwd_s"]
        r["step_speedup"] = base["step_s"] / r["step_s"]
    cols = ["mode", "sp", "tokens", "vision_tokens", "vision_tflop_total", "vision_tflop_rank_max",
            "vision_fwd_s", "vision_speedup", "step_s", "step_speedup", "peak_gib"]  # fmt: skip
    cmd = "python benchmarks/models/bench_sp_vision.py " + " ".join(sys.argv[1:])
    where = "CPU processes (gloo)" if args.device == "cpu" else "one GPU per rank (NCCL)"
    header = (
        f"{args.family} ({args.preset or 'small CPU shape'}), {args.videos} videos x "
        f"{args.frames} frames at {args.size} px + {args.text} text tokens per video, {where}; "
        "times: best of the timed steps, max over ranks; peak: max over ranks"
    )
    harness.report("bench_sp_vision", "lmms-models: vision work split across SP ranks "
                   "(benchmarks/models/bench_sp_vision.py)", rows, cols,
                   {"command": cmd, "header": header}, write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
