"""Making a run fit: the fastest layout that fits (`trainer_args.memory: auto`), what to change
when a config does not fit, and the trainer's preflight check (before the model is built).

Speed of a layout, relative: the forward FLOPs of the blocks it recomputes (2 x block parameters
x tokens each, at 600 TFLOP/s; a `selective` block recomputes its element-wise ops and its
attention, `SELECTIVE_SHARE` of that), FSDP2's collectives with several GPUs (bytes per GPU at
NVLink speed plus a fixed cost per collective: all-gathers and reduce-scatters within a shard
group, an all-reduce across replicas), and FSDP2 CPU offload's traffic at 25 GB/s (16 B per
trained parameter each way; each frozen bf16 weight, e.g. a LoRA base, copied in for the forward
and again for the backward): offload is chosen only when nothing else fits. bf16 AdamW moments are not
slower (`LowPrecisionAdamW`'s fused step moves 20 B per parameter against fp32 state's 28); they
are charged `BF16_STATE_S` anyway, a preference: fp32 state unless bf16 moments save more
recompute than that.
The levers are the trainer's own keys: `activation_checkpointing(_fraction)`,
`vision_activation_checkpointing(_fraction)`, `optimizer_state_dtype`, `fsdp_cpu_offload`, and
with several GPUs `dp_replicate` (FSDP2 shards over `gpus / dp_replicate`, replicated across
the rest: HSDP; `dp_replicate = gpus` is plain replication).
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
    fsdp_shards,
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
    "comm_seconds",
    "fit_suggestions",
    "layout_cost",
    "log_replica_hint",
    "memory_preflight",
    "replica_choices",
]

RECOMPUTE_FLOPS = 600e12
PCIE_BYTES = 25e9
#: a `selective` block's recompute against a full one's (element-wise ops and attention's
#: forward). Timed on an H100 (benchmarks/RESULTS.md, issue 38, 2026-12-05 22:24 UTC): VL-3B 16k
#: with every decoder block selective ran 23-24 ms per step faster than with 13 full blocks; this
#: model predicts 26 ms at 0.2, and the measurement gives 0.21-0.22, within the steps' spread
SELECTIVE_SHARE = 0.2
#: what bf16 AdamW moments are charged (seconds per step): a preference for fp32 state
BF16_STATE_S = 0.01
#: NCCL collectives within one host: bytes per second per GPU, and each collective's fixed cost
NVLINK_BYTES = 150e9
COLLECTIVE_S = 25e-6
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
        share = SELECTIVE_SHARE if mode == "selective" else 1.0
        seconds += (
            share * math.floor(shape.layers * frac) * 2 * per_block * tokens / RECOMPUTE_FLOPS
        )
    if lay.state_dtype == "bfloat16":
        seconds += BF16_STATE_S
    if lay.offload:
        # the trained parameters' state both ways, and every frozen weight (a LoRA base: bf16)
        # copied to the GPU for the forward and again for the backward
        frozen = 2 * 2 * (facts.total - facts.trainable)
        seconds += (2 * 16 * facts.trainable + frozen) / PCIE_BYTES
    return seconds + comm_seconds(facts, lay)


def comm_seconds(facts: ModelFacts, lay: Layout) -> float:
    """FSDP2's collectives per step on `lay.gpus` GPUs of one host: within a shard group of `s`
    two all-gathers of the bf16 weights (forward, and backward after resharding) and a
    reduce-scatter of the fp32 gradients, each moving (s - 1) / s of them per GPU; across `r`
    replicas an all-reduce of each GPU's gradient shard (2 (r - 1) / r of it). Plus a fixed cost
    per collective (one of each kind per block and one for the root module)."""
    if lay.gpus <= 1 or not lay.fsdp:
        return 0.0
    s, r = fsdp_shards(lay), lay.dp_replicate
    moved, kinds = 0.0, 0
    if s > 1:
        moved += (2 * 2 * facts.total + 4 * facts.trainable) * (s - 1) / s
        kinds += 3
    if r > 1:
        moved += 2 * 4 * facts.trainable / s * (r - 1) / r
        kinds += 1
    units = sum(len(b) for b in facts.blocks.values()) + 1
    return moved / NVLINK_BYTES + kinds * units * COLLECTIVE_S


def replica_choices(lay: Layout) -> list[int]:
    """`dp_replicate` values `memory: auto` tries: every divisor of the data-parallel GPUs with
    FSDP2 on several GPUs (from sharding over all of them to plain replication), unless the
    config sets one (> 1) itself; otherwise the config's."""
    dp = lay.gpus // max(1, lay.tp)
    if lay.gpus <= 1 or not lay.fsdp or lay.dp_replicate > 1 or lay.sp > 1 or lay.ep > 1:
        return [lay.dp_replicate]
    return [r for r in range(1, dp + 1) if dp % r == 0]


def _candidates(facts: ModelFacts, lay: Layout, vary_replicas: bool = True) -> list[Layout]:
    towers = [t for t in facts.towers if facts.blocks.get(t)]
    choices: list[dict[str, tuple[str, float]]] = [{}]
    for name in towers:
        n = facts.towers[name].layers
        steps = [(("none", 1.0) if k == 0 else ("full", _fraction(k, n))) for k in range(n + 1)]
        steps.append(("selective", 1.0))
        choices = [{**c, name: s} for c in choices for s in steps]
    states = ["float32", "bfloat16"] if lay.optimizer == "adamw" else [lay.state_dtype]
    offloads = [False, True] if lay.fsdp or lay.gpus == 1 else [False]
    out = []
    for replicas in replica_choices(lay) if vary_replicas else [lay.dp_replicate]:
        for offload in offloads:
            for state in states:
                for ac in choices:
                    fsdp = lay.fsdp or offload
                    out.append(replace(lay, ac={**lay.ac, **ac}, state_dtype=state,
                                       offload=offload, fsdp=fsdp,
                                       dp_replicate=replicas))  # fmt: skip
    return out


def choose_layout(
    facts: ModelFacts, lay: Layout, capacity_gib: float, *, vary_replicas: bool = True
) -> tuple[Layout, MemoryPlan] | None:
    """The cheapest layout (`layout_cost`) that fits, or None; `vary_replicas=False` keeps the
    layout's `dp_replicate` (the trainer's mesh is built before the plan)."""
    best: tuple[float, Layout, MemoryPlan] | None = None
    for cand in _candidates(facts, lay, vary_replicas):
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
    t.dp_replicate = lay.dp_replicate
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
    vary_replicas: bool = False,
) -> MemoryPlan | None:
    """Before the model is built: plan the run; `memory: auto` rewrites the layout to the
    fastest one that fits, `check` raises a `UserError` with the plan and the fixes when it does
    not fit. Returns the plan run (None when skipped: `off`, no GPU, unknown block shapes).
    `vary_replicas`: `auto` may change `dp_replicate` (the caller rebuilds its device mesh);
    otherwise the launched one is kept and a faster one only logged."""
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
        chosen = choose_layout(facts, lay, capacity_gib, vary_replicas=vary_replicas)
        if chosen is None:
            plan = plan_memory(facts, lay, capacity_gib)
            raise UserError(_not_fit_message(facts, lay, plan, capacity_gib, auto=True))
        apply_layout(cfg, chosen[0])
        log(f"[lmms-train] memory: auto chose {chosen[0].describe()}\n{chosen[1].text()}")
        if not vary_replicas:
            log_replica_hint(facts, lay, chosen[0], capacity_gib, log)
        plan = chosen[1]
    else:
        plan = plan_memory(facts, lay, capacity_gib)
        if not plan.fits:
            raise UserError(_not_fit_message(facts, lay, plan, capacity_gib))
    log(f"[lmms-train] memory plan: peak {plan.peak / GIB:.2f} GiB allocated ({plan.moment}), "
        f"{plan.needed / GIB:.1f} of {capacity_gib:.1f} GiB needed")  # fmt: skip
    return plan


def log_replica_hint(
    facts: ModelFacts, lay: Layout, chosen: Layout, capacity_gib: float, log: Any
) -> None:
    """With several GPUs: the FSDP2 degree `memory: auto` ranks fastest over every shard x
    replicate split, logged when it differs from the launched one (the device mesh exists
    before the plan, so the run keeps its own `dp_replicate`; `lmms-train plan --gpus N` shows
    the same choice)."""
    if len(replica_choices(lay)) < 2:
        return
    best = choose_layout(facts, lay, capacity_gib)
    if best is None or best[0].dp_replicate == chosen.dp_replicate:
        return
    gain = layout_cost(facts, chosen) - layout_cost(facts, best[0])
    log(f"[lmms-train] memory: auto: {best[0].describe()} is predicted {gain * 1e3:.0f} ms per "
        f"step faster; launch with trainer_args.dp_replicate: {best[0].dp_replicate}")  # fmt: skip


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
