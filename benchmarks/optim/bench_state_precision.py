"""Convergence of AdamW with low-precision state against fp32 state, on a small LM (CPU).

The check `trainer_args.optimizer_state_dtype: bfloat16` needs before a 7B full fine-tune relies
on it (issue 29): a small Qwen2-shaped causal LM (random init, ~0.3M parameters) trained on a
synthetic language (a random sparse first-order Markov chain over 256 tokens: the loss has a
floor, the entropy of the chain, that a model reaches only by learning the transition table) with

- `fp32`: `torch.optim.AdamW` (fp32 weights, fp32 moments), the reference;
- `bf16-moments-sr`: `lmms_optim.LowPrecisionAdamW`, fp32 weights, bf16 moments rounded
  stochastically (what the trainer's `optimizer_state_dtype: bfloat16` does on top of its fp32
  masters);
- `bf16-all-sr`: bf16 weights and bf16 moments, both rounded stochastically (no fp32 copy at all);
- `bf16-moments-nearest`: bf16 moments rounded to nearest (the control that shows why the rounding
  matters);

each with the same `--seeds` (a seed fixes the initialisation and the data order). Run-to-run
noise is defined as the spread over seeds of the fp32 run: at every window of `--window` steps,
max - min over seeds of the window's mean training loss. A variant is "within noise" when the
mean over seeds of its window loss differs from fp32's by at most that spread, at every window
after the first (the first is the warm-up, where all runs sit at ln 256).

    uv run --all-packages python benchmarks/optim/bench_state_precision.py --write
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import harness

VOCAB = 256
VARIANTS = ("fp32", "bf16-moments-sr", "bf16-all-sr", "bf16-moments-nearest", "bf16-all-nearest")
_PRETRAINED: dict[int, dict] = {}  # seed -> fp32 state after --pretrain-steps (fine-tune mode)


def markov_chain(seed: int = 1234, fanout: int = 4) -> torch.Tensor:
    """[V, V] transition probabilities: each token goes to `fanout` others (fixed for all runs)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.zeros(VOCAB, VOCAB)
    for a in range(VOCAB):
        nxt = torch.randperm(VOCAB, generator=gen)[:fanout]
        probs[a, nxt] = torch.softmax(torch.randn(fanout, generator=gen), 0)
    return probs


def entropy_floor(probs: torch.Tensor) -> float:
    """Mean next-token entropy under the chain's stationary distribution (nats)."""
    pi = torch.full((VOCAB,), 1.0 / VOCAB)
    for _ in range(200):
        pi = pi @ probs
    h = -(probs * probs.clamp_min(1e-30).log()).sum(1)
    return float((pi * h).sum())


def batches(probs: torch.Tensor, seed: int, steps: int, batch: int, seq: int):
    gen = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
        for t in range(1, seq):
            x[:, t] = torch.multinomial(probs[x[:, t - 1]], 1, generator=gen).squeeze(1)
        yield x


def build(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).to(dtype)


def optimizer(name: str, params, lr: float, seed: int) -> torch.optim.Optimizer:
    from lmms_optim import LowPrecisionAdamW

    kw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if name == "fp32":
        return torch.optim.AdamW(params, foreach=False, **kw)
    rounding = "nearest" if name.endswith("nearest") else "stochastic"
    return LowPrecisionAdamW(params, state_dtype=torch.bfloat16, rounding=rounding, seed=seed, **kw)


def pretrained(seed: int, args) -> dict:
    """Fine-tune mode: the fp32 model after `--pretrain-steps` of fp32 AdamW on the first chain
    (the same starting point for every variant of a seed)."""
    if seed not in _PRETRAINED:
        model = build(seed, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False, weight_decay=0.01)
        for x in batches(markov_chain(), seed, args.pretrain_steps, args.batch, args.seq):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _PRETRAINED[seed] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _PRETRAINED[seed]


def run(name: str, seed: int, probs, args) -> list[float]:
    bf16_weights = name.startswith("bf16-all")
    model = build(seed, torch.float32)
    lr = args.lr
    if args.pretrain_steps:
        model.load_state_dict(pretrained(seed, args))
        lr = args.finetune_lr
    model = model.to(torch.bfloat16 if bf16_weights else torch.float32)
    opt = optimizer(name, model.parameters(), lr, seed)
    losses = []
    for x in batches(probs, seed, args.steps, args.batch, args.seq):
        loss = model(input_ids=x, labels=x).loss
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def windows(losses: list[float], w: int) -> list[float]:
    return [statistics.fmean(losses[i : i + w]) for i in range(0, len(losses), w)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=0,
        help="fine-tune mode: first this many fp32 steps on one chain (shared by the variants), "
        "then --steps on another chain at --finetune-lr, where updates are far below a weight's "
        "bf16 ulp (the regime of fine-tuning a pretrained model)",
    )
    p.add_argument("--finetune-lr", type=float, default=3e-5)
    p.add_argument("--write", action="store_true", help="write the section of RESULTS.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    probs = markov_chain(seed=4321) if args.pretrain_steps else markov_chain()
    floor = entropy_floor(probs)
    curves: dict[str, list[list[float]]] = {}
    t0 = time.perf_counter()
    for name in args.variants:
        curves[name] = [windows(run(name, s, probs, args), args.window) for s in args.seeds]
        print(f"{name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    ref = curves["fp32"]
    n_win = len(ref[0])
    mean = {k: [statistics.fmean(c[i] for c in v) for i in range(n_win)] for k, v in curves.items()}
    spread = [max(c[i] for c in ref) - min(c[i] for c in ref) for i in range(n_win)]
    headers = ["steps", "fp32 spread", *[f"{k} mean" for k in curves]]
    rows = [
        [f"{i * args.window + 1}-{min((i + 1) * args.window, args.steps)}", f"{spread[i]:.4f}",
         *[f"{mean[k][i]:.4f}" for k in curves]]
        for i in range(n_win)
    ]  # fmt: skip
    verdicts = []
    for k in curves:
        if k == "fp32":
            continue
        gaps = [abs(mean[k][i] - mean["fp32"][i]) - spread[i] for i in range(1, n_win)]
        worst = max(range(1, n_win), key=lambda i: gaps[i - 1])
        ok = all(g <= 0 for g in gaps)
        verdicts.append(
            [k, "within noise" if ok else "outside noise",
             f"{abs(mean[k][worst] - mean['fp32'][worst]):.4f} vs spread {spread[worst]:.4f} "
             f"(steps {rows[worst][0]})", f"{mean[k][-1]:.4f}"]
        )  # fmt: skip
    body = (
        f"Small Qwen2-shaped LM (2 layers, hidden 64, vocab {VOCAB}, "
        f"{sum(p.numel() for p in build(0, torch.float32).parameters()):,} parameters), "
        f"synthetic Markov-chain text (entropy floor {floor:.3f} nats), "
        + (
            f"fine-tuning: {args.pretrain_steps} fp32 AdamW steps on another chain first (lr "
            f"{args.lr}), then {args.steps} steps on this one at lr {args.finetune_lr} (updates "
            "far below a weight's bf16 ulp); "
            if args.pretrain_steps
            else ""
        )
        + f"{args.steps} steps of {args.batch}x{args.seq} tokens, AdamW lr "
        f"{args.finetune_lr if args.pretrain_steps else args.lr}, betas (0.9, 0.999), weight decay "
        f"0.01, clip 1.0, seeds {args.seeds} (initialisation and data order); one CPU thread.\n\n"
        "Mean training loss per window, over seeds; `fp32 spread` = max - min over seeds of the "
        "fp32 run (the run-to-run noise):\n\n"
        + harness.markdown_table(headers, rows)
        + "\n\nVerdict (every window after the first: |mean - fp32 mean| <= fp32 spread):\n\n"
        + harness.markdown_table(
            ["variant", "verdict", "largest gap", "last window mean"], verdicts
        )
        + f"\n\nWall time {time.perf_counter() - t0:.0f} s.\n"
    )
    print(body)
    if args.write:
        cmd = "uv run --all-packages python benchmarks/optim/bench_state_precision.py " + " ".join(
            sys.argv[1:]
        )
        mode = "fine-tuning" if args.pretrain_steps else "from scratch"
        harness.write_section(
            f"lmms-optim: AdamW state precision, convergence {mode} "
            "(benchmarks/optim/bench_state_precision.py)",
            body,
            command=cmd,
        )
    if not all(math.isfinite(x) for v in mean.values() for x in v):
        sys.exit(1)


if __name__ == "__main__":
    main()
