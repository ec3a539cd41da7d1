"""What a person reads at the start and end of a run, and the number formats of the console.

`start_banner`: model, parameters, devices and mesh, data, output folder, resumed from.
`end_summary`: one line with steps, tokens, time, final loss and where things were written.
`human` / `duration`: 1.23M, 45.6k; 1h02m, 3m05s, 12.3s (plain text, no terminal codes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["duration", "end_summary", "human", "start_banner"]

_TAG = "[lmms-train]"


def human(n: float, digits: int = 3) -> str:
    """`1234567` -> `1.23M`; small numbers as they are (`12`, `0.5`)."""
    if n is None or not math.isfinite(n):
        return str(n)
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.{digits}g}{suffix}"
    return f"{n:.{digits}g}" if isinstance(n, float) else str(n)


def duration(seconds: float) -> str:
    """`3725` -> `1h02m`, `185` -> `3m05s`, `12.34` -> `12.3s`."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _params(model: nn.Module) -> tuple[int, int]:
    total = trainable = 0
    for p in model.parameters():
        n = p.numel()  # a DTensor's numel is its global size
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def start_banner(
    cfg: Any, env: Any, spec: Any, model: nn.Module, *, out: Path, resumed: Path | None, step: int
) -> str:
    """A few plain lines: what trains, where, on what, from which data, into which folder."""
    m, d, t = cfg.model_config, cfg.dataset_config, cfg.trainer_args
    source = m.load_from_pretrained_path or (
        f"{m.load_from_config.model_type} "
        + ("tiny config" if m.load_from_config.tiny else m.load_from_config.preset or "config")
    )
    total, trainable = _params(model)
    frozen = f", {human(total - trainable)} frozen" if total != trainable else ""
    precision = "bf16 compute, fp32 master weights" if t.bf16 else "fp32"
    mesh = (
        f"dp {env.dp_size} (replicate {env.dp_replicate}), sp {env.sp}, tp {getattr(env, 'tp', 1)}, "
        f"ep {getattr(env, 'ep', 1)}"
    )
    paths = d.dataset_path if isinstance(d.dataset_path, list) else [d.dataset_path]
    per_step = d.packing_length * t.gradient_accumulation_steps * env.dp_size
    packing = (
        f"packs of {human(d.packing_length)} tokens x {t.gradient_accumulation_steps} per rank x "
        f"{env.dp_size} ranks = {human(per_step)} tokens per step"
        if d.packing
        else f"one sample per micro-batch x {t.gradient_accumulation_steps * env.dp_size} per step"
    )
    lines = [
        f"model    {spec.name} from {source}: {human(total)} parameters{frozen}; {precision}",
        f"devices  {env.world_size} x {env.device.type} ({'FSDP2' if env.fsdp else 'one process'}); "
        f"mesh {mesh}",
        f"data     {', '.join(map(str, paths))}; {packing}; {d.num_workers} workers per rank",
        f"output   {out} (metrics.jsonl, checkpoints/{', hf/' if t.export_hf else ''}); "
        + (
            f"{t.max_steps:,} steps; "
            if t.max_steps > 0
            else f"until {cfg.dataset_config.num_epochs} pass(es) over the data end; "
        )
        + (f"resumed from {resumed} at step {step:,}" if resumed is not None else "fresh start"),
    ]
    return "\n".join(f"{_TAG} {ln}" for ln in lines)


def end_summary(
    *, out: Path, steps: int, max_steps: int, tokens: int, seconds: float,
    metrics: dict[str, Any] | None, stopped: bool, exported: bool, checkpoint: Path | None = None,
) -> str:  # fmt: skip
    """One line: steps, tokens, time, final loss, where things were written (`checkpoint`: this
    run's last one)."""
    loss = (metrics or {}).get("loss")
    loss_text = (
        f"final loss {loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "no loss"
    )
    written = [str(out / "metrics.jsonl")]
    if checkpoint is not None:
        written.append(str(checkpoint))
    if exported:
        written.append(str(out / "hf"))
    if (out / "metrics.png").is_file():
        written.append(str(out / "metrics.png"))
    state = "stopped (SIGTERM) at" if stopped else "done:"
    rate = f" ({human(tokens / seconds)} tokens/s)" if seconds > 0 else ""
    return (
        f"{_TAG} {state} {steps:,}{f'/{max_steps:,}' if max_steps > 0 else ''} steps, "
        f"{human(tokens)} tokens in "
        f"{duration(seconds)}{rate}, {loss_text}; wrote {', '.join(written)}"
    )
