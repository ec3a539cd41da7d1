"""`trainer_args.compile_warmup`: compile what the run needs before step 1 is timed.

With `compile: true`, the first forward of every block traces and compiles it (dynamic shapes:
later pack lengths reuse the graph), the backward compiles on the first backward, and FA4 compiles
a kernel per size class the first time a call falls in it (`lmms_kernels.warm_attention`). Left to
the steps, the first step carries the compilation and some later step a new FA4 variant (5-9 s
on a cold cache, benchmarks/models/NOTES.md item 27). The warm-up does it all before step 1:

1. one forward and backward of the first step's first pack (every block graph, both grad modes
   where activation checkpointing recomputes under no_grad), and a forward without gradients
   when the run evaluates;
2. every attention signature those calls recorded, replayed forward and backward with segment
   counts on both sides of FA4's varlen batch threshold.

Nothing of it reaches training: on one process the gradients are taken with
`torch.autograd.grad` (no `.grad` is written and no accumulation hook fires); under FSDP the
backward runs as usual and every gradient is dropped afterwards. The objective's step metrics and
the RNG states are restored, so step 1 computes what it would have computed without the warm-up.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch

import lmms_kernels

if TYPE_CHECKING:  # _loop imports this module
    from lmms_train._loop import Run

__all__ = ["warm_up"]


def _rng_state(device: torch.device) -> tuple[Any, Any]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, Any], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def warm_up(run: Run, batch: dict[str, Any], *, evaluate: bool = False) -> dict[str, float]:
    """Run the warm-up on `batch` (already on the device); returns what it did, for the log:
    seconds, dynamo graphs compiled, attention replays and FA4 kernels added."""
    model, env = run.model, run.env
    t0 = time.perf_counter()
    graphs0 = lmms_kernels.compile_counts()["graphs"]
    fa4_0 = lmms_kernels.fa4_variants() or 0
    rng = _rng_state(env.device)
    fsdp = hasattr(model, "set_requires_gradient_sync")
    run.forward.begin_step(run.state.step + 1)  # the same draws as the step's own
    loss_sum, _ = run.forward(model, batch)
    loss = loss_sum.float() * 0.0  # its gradients are never applied
    if fsdp:
        loss.backward()
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        torch.autograd.grad(loss, params, allow_unused=True)
    if evaluate:
        model.eval()
        with torch.no_grad():
            run.forward(model, batch)
        model.train()
    replays = lmms_kernels.warm_attention()
    if fsdp:
        model.zero_grad(set_to_none=True)
        run.optimizer.zero_grad(set_to_none=True)
    run.forward.take_metrics()  # the warm-up's objective metrics are not the step's
    _discard_moe_counts(run)
    _set_rng_state(rng, env.device)
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    out = {
        "seconds": time.perf_counter() - t0,
        "graphs": float(lmms_kernels.compile_counts()["graphs"] - graphs0),
        "attention_replays": float(replays),
        "fa4_kernels": float((lmms_kernels.fa4_variants() or 0) - fa4_0),
    }
    if env.is_main:
        print(
            f"[lmms-train] compile warm-up: {out['seconds']:.1f}s, {out['graphs']:.0f} graphs, "
            f"{replays} attention replays, {out['fa4_kernels']:.0f} new FA4 kernels",
            file=sys.stderr,
            flush=True,
        )
    return out


def _discard_moe_counts(run: Any) -> None:
    """MoE families count tokens per expert during forward; the warm-up's are not step 1's."""
    from lmms_models import expert_load_meter

    meter = expert_load_meter(run.model)
    if meter is not None:
        meter.take(run.env.device)
