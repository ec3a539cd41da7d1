"""Out of device memory during training: one message with the step, the memory and what to change.

torch's own message names the failed allocation and the allocator's state; what a user needs next
is which of this run's settings trade memory for time, with their current values. The traceback
stays available with `LMMS_TRAIN_DEBUG=1` (the CLI re-raises instead of printing the message).
"""

from __future__ import annotations

from typing import Any

import torch

from lmms_train._errors import UserError

__all__ = ["out_of_memory"]


def out_of_memory(exc: BaseException, cfg: Any, step: int, device: torch.device) -> UserError:
    """The `UserError` to raise from `exc` (a `torch.OutOfMemoryError`) at optimizer step `step`."""
    t, d = cfg.trainer_args, cfg.dataset_config
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lines = [f"out of device memory in step {step}: {first}"]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        lines.append(f"peak allocated {peak:.1f} GiB of {total:.1f} GiB")
    lines.append("settings that trade memory for time (current values):")
    if t.activation_checkpointing == "none":
        lines.append("- trainer_args.activation_checkpointing: none -> full (or selective)")
    elif t.activation_checkpointing_fraction < 1.0:
        lines.append(
            f"- trainer_args.activation_checkpointing_fraction: "
            f"{t.activation_checkpointing_fraction} -> higher (1.0 checkpoints every block)"
        )
    if t.vision_activation_checkpointing == "none":
        lines.append("- trainer_args.vision_activation_checkpointing: none -> full")
    if t.gradient_accumulation_steps > 1:
        lines.append(
            f"- trainer_args.gradient_accumulation_steps: {t.gradient_accumulation_steps}: "
            "the gradients of earlier micro-batches (fp32, 4 bytes per trainable parameter) stay "
            "allocated through the later ones' forward; a layout that fits with 1 may not with more"
        )
    lines.append(f"- dataset_config.packing_length: {d.packing_length} -> lower")
    if t.optimizer == "adamw":
        lines.append("- trainer_args.optimizer: adamw keeps 8 bytes of state per parameter, muon 4")
    lines.append(
        "- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when much memory is reserved but "
        "unallocated (fragmentation)"
    )
    lines.append("(LMMS_TRAIN_DEBUG=1 shows the traceback)")
    return UserError("\n".join(lines))
