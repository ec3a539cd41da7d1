"""Linear attention speed (issue 27): the varlen Gated DeltaNet ops, then a Qwen3.5-2B-shaped
training step on packed text, lmms against upstream transformers + flash-linear-attention, all
measured in the same run on the same samples.

Ops (``--ops``): ``gated_delta_rule_varlen`` and ``causal_conv1d_varlen`` forward + backward on
one packed row of ``--tokens`` tokens (log-normal sample lengths, bf16, Qwen3.5's linear layer:
16 key / 32 value heads of 128 unless ``--heads``), backends ``fla`` (flash-linear-attention's
varlen kernels) and ``torch`` (the plain-torch reference). TFLOP/s use the chunked-form count of
``lmms_models._linear_spec`` (3x forward for forward + backward).

Model step (default): preset ``2b`` of ``qwen3_5`` (random weights, decoder only: text rows, the
vision tower is not called), fp32 weights under bf16 autocast, fused AdamW, every other decoder
block checkpointed, ``--steps`` timed steps:

* ``lmms``: one packed row of ``--tokens`` tokens through ``spec.packed_forward`` (lmms varlen
  attention for the 6 softmax layers, the packed mixers on fla's kernels, fused linear CE).
* ``upstream``: the same samples as padded micro-batches of at most ``--hf-micro-tokens`` padded
  tokens through ``model(input_ids, attention_mask, labels)`` with transformers' SDPA attention
  and its own mixers (fla's kernels when installed, its torch convolution), summed gradients.

* ``lmms_compiled`` (``--compile``): the lmms step with the decoder blocks compiled as
  ``trainer_args.compile`` does (Inductor, dynamic shapes, after activation checkpointing; the
  linear-attention ops are custom ops in the graphs), timed after the eager cases.

MFU = lmms_models FLOPs (``spec.lm_flops``: 6N + softmax attention in the full layers + the
chunked delta rule in the linear layers) / step time / 989 TFLOP/s (H100/H200 dense bf16).

    python benchmarks/models/bench_linear.py --ops            # ~1 min
    python benchmarks/models/bench_linear.py --tokens 16384    # ~5 min
    python benchmarks/models/bench_linear.py --tokens 16384 --compile
    python benchmarks/models/bench_linear.py --tiny --cpu      # plumbing check on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from typing import Any

import torch

PEAK = 989e12


def _lengths(total: int, rng: random.Random, mean_log: float) -> list[int]:
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(max(1, min(total - sum(lens), int(rng.lognormvariate(mean_log, 1.0)))))
    return lens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ops(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    from lmms_kernels import causal_conv1d_varlen, gated_delta_rule_varlen
    from lmms_models._linear_spec import delta_rule_flops_per_token

    hk, hv, d = args.heads
    lens = _lengths(args.tokens, random.Random(args.seed), math.log(1500))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    t = args.tokens
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def make():
        q, k = (torch.randn(t, hk, d, device=device, dtype=dt, requires_grad=True) for _ in "qk")
        v = torch.randn(t, hv, d, device=device, dtype=dt, requires_grad=True)
        g = (-torch.rand(t, hv, device=device) * 0.1).requires_grad_()
        beta = torch.rand(t, hv, device=device, dtype=dt).requires_grad_()
        return q, k, v, g, beta

    rows = []
    flops = delta_rule_flops_per_token(hv, d, d) * t
    backends = ["fla", "torch"] if device.type == "cuda" else ["torch"]
    for be in backends:
        xs = make()

        def step(xs=xs, be=be):
            o = gated_delta_rule_varlen(*xs, cu, backend=be)
            o.float().sum().backward()

        ms = _time(step, device, args.warmup, args.steps)
        rows.append({"op": "gated_delta_rule", "backend": be, "tokens": t, "ms": ms,
                     "tflops": flops / ms / 1e9})  # fmt: skip
        x = torch.randn(t, (2 * hk + hv) * d, device=device, dtype=dt, requires_grad=True)
        w = torch.randn(x.shape[1], 4, device=device, dtype=dt, requires_grad=True)

        def conv(be=be, x=x, w=w):
            causal_conv1d_varlen(x, w, None, cu, backend=be).float().sum().backward()

        rows.append({"op": "causal_conv1d", "backend": be, "tokens": t,
                     "ms": _time(conv, device, args.warmup, args.steps)})  # fmt: skip
    return rows


def _time(fn, device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def bench_model(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    from lmms_models import get_model_spec
    from lmms_models.testing import pack_samples
    from lmms_parallel import apply_activation_checkpointing

    spec = get_model_spec("qwen3_5")
    cfg = spec.tiny_config() if args.tiny else spec.preset("2b")
    torch.manual_seed(args.seed)
    model = spec.build(config=cfg, device=device, attn_backend=args.backend)
    model.train()
    text_cfg = spec.text_config(model.config)
    rng = random.Random(args.seed)
    lens = _lengths(args.tokens, rng, math.log(64 if args.tiny else 1500))
    gen = torch.Generator().manual_seed(args.seed)
    samples = []
    for n in lens:
        ids = torch.randint(0, min(text_cfg.vocab_size, 1000 if args.tiny else 150000), (n,),
                            generator=gen)  # fmt: skip
        samples.append({"input_ids": ids, "labels": ids.clone()})
    batch = pack_samples(spec, model, samples)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    apply_activation_checkpointing(spec.decoder_blocks(model), "full", fraction=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    flops = spec.lm_flops(model.config, lens)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    n_tok = sum(lens)

    def lmms_step():
        with amp:
            loss, count = spec.packed_forward(model, batch)
        (loss / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    micro = _micro_batches(samples, args.hf_micro_tokens, device)

    def upstream_step():
        for ids, mask, labels in micro:
            with amp:
                out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
            (out.loss * (labels[:, 1:] != -100).sum() / n_tok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def compiled_step():
        if not hasattr(compiled_step, "handle"):  # compile once, after the eager cases
            from lmms_kernels import compile_blocks

            compiled_step.handle = compile_blocks(spec.decoder_blocks(model))
        lmms_step()

    cases = [("lmms", lmms_step, args.backend), ("upstream", upstream_step, "sdpa")]
    if args.compile:
        cases.append(("lmms_compiled", compiled_step, args.backend))
    rows = []
    for name, fn, backend in cases:
        spec.set_attention(model, backend=backend)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            ms = _time(fn, device, args.warmup, args.steps)
        except torch.OutOfMemoryError:
            rows.append({"case": name, "tokens": n_tok, "error": "out of memory"})
            opt.zero_grad(set_to_none=True)
            continue
        except Exception as e:  # a failing compiled case still reports the eager ones
            if name != "lmms_compiled":
                raise
            rows.append({"case": name, "tokens": n_tok, "error": f"{type(e).__name__}: {e}"[:500]})
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        rows.append({"case": name, "tokens": n_tok, "samples": len(lens), "ms": ms,
                     "tokens_per_s": n_tok / ms * 1e3, "mfu": flops / (ms / 1e3) / PEAK,
                     "peak_gib": peak})  # fmt: skip
    return rows


def _micro_batches(samples: list[dict], max_padded: int, device: torch.device):
    """Padded batches of the samples in order: at most ``max_padded`` padded tokens each."""
    out, cur = [], []
    for s in [*samples, None]:
        if (
            s is not None
            and (len(cur) + 1) * max([len(x["input_ids"]) for x in cur] + [len(s["input_ids"])])
            <= max_padded
        ):
            cur.append(s)
            continue
        if cur:
            width = max(len(x["input_ids"]) for x in cur)
            ids = torch.zeros(len(cur), width, dtype=torch.long)
            mask = torch.zeros(len(cur), width, dtype=torch.long)
            labels = torch.full((len(cur), width), -100, dtype=torch.long)
            for i, x in enumerate(cur):
                n = len(x["input_ids"])
                ids[i, :n], mask[i, :n], labels[i, :n] = x["input_ids"], 1, x["labels"]
            out.append((ids.to(device), mask.to(device), labels.to(device)))
        cur = [s] if s is not None else []
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", action="store_true", help="time the varlen ops only")
    p.add_argument("--tiny", action="store_true", help="tiny model (plumbing check)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, nargs=3, default=[16, 32, 128], metavar=("HK", "HV", "D"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="auto", help="lmms varlen attention backend")
    p.add_argument("--hf-micro-tokens", type=int, default=8192)
    p.add_argument("--compile", action="store_true", help="also time the compiled lmms step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="append JSON lines here")
    args = p.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    rows = bench_ops(args, device) if args.ops else bench_model(args, device)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    for r in rows:
        line = json.dumps({**info, **r})
        print(line)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
