"""Making a run fit: the fastest layout that fits (`trainer_args.memory: auto`), what to change
when a config does not fit, and the trainer's preflight check (before the model is built).

Speed of a layout, relative: the forward FLOPs of the blocks it recomputes (2 x block parameters
x tokens each, at 600 TFLOP/s), bf16 AdamW moments' extra pass over the parameters (12 B each at
2.5 TB/s: `LowPrecisionAdamW` is not fused with the masters' write-back), and FSDP2 CPU offload's
traffic (16 B per parameter each way at 25 GB/s): offload is chosen only when nothing else fits.
The levers are the trainer's own keys: `activation_checkpointing(_fraction)`,
`vision_activation_checkpointing(_fraction)`, `optimizer_state_dtype`, `fsdp_cpu_offload`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lmms_train._errors import UserError
from lmms_train._memory import (
    DEFAULT_GPU_GIB,
    GIB,
    Layout,
    MemoryPlan,
    ModelFacts,
    layout_of,
    model_facts,
    plan_memory,
    tower_tokens,
)
from lmms_train.config import TrainConfig

__all__ = [
    "DEFAULT_GPU_GIB",
    "apply_layout",
    "choose_layout",
    "fit_suggestions",
    "layout_cost",
    "memory_preflight",
]

RECOMPUTE_FLOPS = 600e12
STATE_PASS_BYTES = 2.5e12
PCIE_BYTES = 25e9
#: `memory: auto` keeps this share of the predicted need free on top (the plan's error)
AUTO_SAFETY = 0.03


def _fraction(k: int, n: int) -> float:
    """A fraction that checkpoints exactly k of n blocks (`floor(n * f) == k`)."""
    if k >= n:
        return 1.0
    f = k / n
    while math.floor(n * f) < k:
        f = math.nextafter(f, 1.0)
    return f


def layout_cost(facts: ModelFacts, lay: Layout) -> float:
    """Seconds a layout adds to a step over no checkpointing with fp32 state on the GPU."""
    seconds = 0.0
    for name, shape in facts.towers.items():
        mode, frac = lay.ac.get(name, ("none", 1.0))
        if mode == "none":
            continue
        blocks = facts.blocks.get(name, [])
        per_block = sum(p for p, _ in blocks) / max(1, len(blocks))
        tokens = tower_tokens(name, shape, lay)
        share = 0.35 if mode == "selective" else 1.0
        seconds += (
            share * math.floor(shape.layers * frac) * 2 * per_block * tokens / RECOMPUTE_FLOPS
        )
    if lay.state_dtype == "bfloat16":
        seconds += 12 * facts.trainable / STATE_PASS_BYTES
    if lay.offload:
        seconds += 2 * 16 * facts.trainable / PCIE_BYTES
    return seconds


def _candidates(facts: ModelFacts, lay: Layout) -> list[Layout]:
    towers = [t for t in facts.towers if facts.blocks.get(t)]
    choices: list[dict[str, tuple[str, float]]] = [{}]
    for name in towers:
        n = facts.towers[name].layers
        steps = [(("none", 1.0) if k == 0 else ("full", _fraction(k, n))) for k in range(n + 1)]
        choices = [{**c, name: s} for c in choices for s in steps]
    states = ["float32", "bfloat16"] if lay.optimizer == "adamw" else [lay.state_dtype]
    offloads = [False, True] if lay.fsdp or lay.gpus == 1 else [False]
    out = []
    for offload in offloads:
        for state in states:
            for ac in choices:
                fsdp = lay.fsdp or offload
                out.append(replace(lay, ac={**lay.ac, **ac}, state_dtype=state,
                                   offload=offload, fsdp=fsdp))  # fmt: skip
    return out


def choose_layout(
    facts: ModelFacts, lay: Layout, capacity_gib: float
) -> tuple[Layout, MemoryPlan] | None:
    """The cheapest layout (`layout_cost`) that fits, or None."""
    best: tuple[float, Layout, MemoryPlan] | None = None
    for cand in _candidates(facts, lay):
        cost = layout_cost(facts, cand)
        if best is not None and cost >= best[0]:
            continue
        plan = plan_memory(facts, cand, capacity_gib)
        if plan.needed * (1 + AUTO_SAFETY) <= plan.capacity:
            best = (cost, cand, plan)
    return None if best is None else (best[1], best[2])


def fit_suggestions(facts: ModelFacts, lay: Layout, capacity_gib: float) -> list[str]:
    """One line per change that would make `lay` fit, with its predicted need."""
    out: list[str] = []

    def need(cand: Layout) -> MemoryPlan:
        return plan_memory(facts, cand, capacity_gib)

    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus <= lay.gpus:
            continue
        plan = need(replace(lay, gpus=gpus, fsdp=True))
        if plan.fits:
            out.append(f"more GPUs: {gpus} (FSDP2) need {plan.needed / GIB:.1f} GiB each")
            break
    full = {k: ("full", 1.0) for k in facts.towers}
    plan = need(replace(lay, ac={**lay.ac, **full}))
    if plan.fits and lay.ac != {**lay.ac, **full}:
        out.append(
            "activation checkpointing of every block (activation_checkpointing: full, "
            "activation_checkpointing_fraction: 1.0, vision_activation_checkpointing: same): "
            f"{plan.needed / GIB:.1f} GiB"
        )
    if lay.optimizer == "adamw" and lay.state_dtype == "float32":
        plan = need(replace(lay, state_dtype="bfloat16"))
        if plan.fits:
            out.append(f"optimizer_state_dtype: bfloat16: {plan.needed / GIB:.1f} GiB")
    if not lay.offload:
        plan = need(replace(lay, offload=True, fsdp=True))
        if plan.fits:
            out.append(f"fsdp: true, fsdp_cpu_offload: true (slow): {plan.needed / GIB:.1f} GiB")
    tokens = lay.tokens
    while tokens > 1024:
        tokens //= 2
        plan = need(replace(lay, tokens=tokens))
        if plan.fits:
            out.append(f"packing_length: {tokens}: {plan.needed / GIB:.1f} GiB")
            break
    auto = choose_layout(facts, lay, capacity_gib)
    if auto is not None:
        out.append(f"memory: auto would run {auto[0].describe()} ({auto[1].needed / GIB:.1f} GiB)")
    return out


def apply_layout(cfg: TrainConfig, lay: Layout) -> None:
    """Write a chosen layout into `cfg.trainer_args` (the keys `memory: auto` may change)."""
    t = cfg.trainer_args
    mode, frac = lay.ac.get("decoder", (t.activation_checkpointing, 1.0))
    t.activation_checkpointing, t.activation_checkpointing_fraction = mode, frac
    if "vision" in lay.ac:
        t.vision_activation_checkpointing, t.vision_activation_checkpointing_fraction = lay.ac[
            "vision"
        ]
    t.optimizer_state_dtype = lay.state_dtype
    if lay.offload:
        t.fsdp, t.fsdp_cpu_offload = True, True


def memory_preflight(
    cfg: TrainConfig,
    spec: Any,
    token_ids: dict[str, Any] | None,
    *,
    gpus: int,
    capacity_gib: float | None,
    log: Any = print,
) -> MemoryPlan | None:
    """Before the model is built: plan the run; `memory: auto` rewrites the layout to the
    fastest one that fits, `check` raises a `UserError` with the plan and the fixes when it does
    not fit. Returns the plan run (None when skipped: `off`, no GPU, unknown block shapes)."""
    t = cfg.trainer_args
    if t.memory == "off" or capacity_gib is None:
        return None
    try:
        facts = model_facts(cfg, spec, token_ids)
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError, ImportError,
            OSError) as exc:  # fmt: skip
        log(f"[lmms-train] memory plan skipped: {spec.name} did not build on meta ({exc})")
        return None
    if not facts.towers:
        log(f"[lmms-train] memory plan skipped: {facts.why_unknown}")
        return None
    lay = layout_of(cfg, gpus=gpus)
    if t.memory == "auto":
        chosen = choose_layout(facts, lay, capacity_gib)
        if chosen is None:
            plan = plan_memory(facts, lay, capacity_gib)
            raise UserError(_not_fit_message(facts, lay, plan, capacity_gib, auto=True))
        apply_layout(cfg, chosen[0])
        log(f"[lmms-train] memory: auto chose {chosen[0].describe()}\n{chosen[1].text()}")
        plan = chosen[1]
    else:
        plan = plan_memory(facts, lay, capacity_gib)
        if not plan.fits:
            raise UserError(_not_fit_message(facts, lay, plan, capacity_gib))
    log(f"[lmms-train] memory plan: peak {plan.peak / GIB:.2f} GiB allocated ({plan.moment}), "
        f"{plan.needed / GIB:.1f} of {capacity_gib:.1f} GiB needed")  # fmt: skip
    return plan


def _not_fit_message(
    facts: ModelFacts, lay: Layout, plan: MemoryPlan, capacity_gib: float, *, auto: bool = False
) -> str:
    head = (
        "memory: auto found no layout that fits"
        if auto
        else f"this config does not fit the GPU ({plan.needed / GIB:.1f} GiB needed, "
        f"{capacity_gib:.1f} GiB on the device); stopped before building the model"
    )
    fixes = fit_suggestions(facts, lay, capacity_gib)
    lines = [head, plan.text(), "settings that would make it fit:" if fixes else "nothing found"]
    lines += [f"- {f}" for f in fixes]
    lines.append("(trainer_args.memory: off skips this check)")
    return "\n".join(lines)
