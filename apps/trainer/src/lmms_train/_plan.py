"""`lmms-train plan CONFIG.yaml [section.key=value ...] [--gpus N] [--gpu-mem GiB] [--media-share X]`

Prints the memory plan of CONFIG's layout on N GPUs of the given memory (default: this
machine's GPU, else an H100 80 GB, 79.2 GiB as torch reports it), nothing built on a GPU: the
model is built on the meta device. When it does not fit: the settings that would make it fit.
Always: the layout `trainer_args.memory: auto` would pick. Exit 0 (fits) or 3 (does not fit).
A Hub id as the model or processor (`org/name[@revision]`) is read from the Hugging Face cache
(downloaded first unless HF_HUB_OFFLINE=1: its configs and tokenizer files, never the weights).
"""

from __future__ import annotations

from typing import Any

from lmms_train._cli_args import take_option
from lmms_train._errors import UserError

__all__ = ["PLAN_USAGE", "plan_main", "plan_report"]

PLAN_USAGE = (
    "usage: lmms-train plan CONFIG.yaml [section.key=value ...] [--gpus N] [--gpu-mem GiB] "
    "[--media-share X]"
)
EXIT_DOES_NOT_FIT = 3


def plan_report(
    cfg: Any, *, gpus: int = 1, gpu_gib: float | None = None, media_share: float | None = None
) -> tuple[str, Any, Any]:
    """(text, plan of the config's layout, auto's (layout, plan) or None) for `cfg`."""
    from lmms_train._memory import DEFAULT_GPU_GIB, device_gib, layout_of, model_facts, plan_memory
    from lmms_train._memory_fit import choose_layout, fit_suggestions
    from lmms_train._model_setup import resolve_spec

    spec = resolve_spec(cfg)
    capacity = gpu_gib or device_gib() or DEFAULT_GPU_GIB
    if media_share is not None:
        cfg.trainer_args.memory_media_share = media_share
    facts = model_facts(cfg, spec)
    head = f"{spec.name}: {facts.total / 1e9:.2f}B parameters, {facts.trainable / 1e9:.2f}B trained"
    if not facts.towers:
        return f"{head}\nno activation plan: {facts.why_unknown}", None, None
    lay = layout_of(cfg, gpus=gpus)
    plan = plan_memory(facts, lay, capacity)
    lines = [head, plan.text()]
    if not plan.fits:
        fixes = fit_suggestions(facts, lay, capacity)
        lines.append("settings that would make it fit:" if fixes else "no setting found that fits")
        lines += [f"- {f}" for f in fixes]
    auto = choose_layout(facts, lay, capacity)
    if auto is None:
        lines.append("memory: auto: no layout fits")
    else:
        lines += ["memory: auto would pick:", auto[1].text()]
    return "\n".join(lines), plan, auto


def plan_main(args: list[str]) -> int:
    """The subcommand: print the plan; exit 0 if the config fits, 3 if not."""
    from lmms_train.config import load_config

    args, gpus = take_option(args, "--gpus", PLAN_USAGE)
    args, mem = take_option(args, "--gpu-mem", PLAN_USAGE)
    args, share = take_option(args, "--media-share", PLAN_USAGE)
    if not args or args[0].startswith("-") or "=" in args[0]:
        raise UserError(PLAN_USAGE)
    try:
        n = int(gpus) if gpus else 1
        gib = float(mem) if mem else None
        media = float(share) if share else None
    except ValueError as exc:
        raise UserError(f"{PLAN_USAGE}\n{exc}") from None
    cfg = load_config(args[0], args[1:])
    from lmms_train._hub_ids import raise_hub_problems

    raise_hub_problems(cfg, weights=False, datasets=False)  # Hub ids -> cache folders (config only)
    text, plan, _ = plan_report(cfg, gpus=n, gpu_gib=gib, media_share=media)
    print(text, flush=True)
    return 0 if plan is None or plan.fits else EXIT_DOES_NOT_FIT
