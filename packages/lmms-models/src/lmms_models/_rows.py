"""Helpers on packed rows shared by the specs and the objectives: the ignored label, next-token
targets within each sample of a row, and host-to-device moves that do not make the host wait."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["IGNORE_INDEX", "batch_shift_labels", "shift_labels_packed", "to_device"]

IGNORE_INDEX = -100


def shift_labels_packed(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``labels [T]`` shifted left within each segment; each segment's last position is ignored."""
    out = torch.full_like(labels, IGNORE_INDEX)  # [T]
    out[:-1] = labels[1:]
    ends = cu_seqlens[1:].to(labels.device).long() - 1
    out[ends[ends >= 0]] = IGNORE_INDEX
    return out


def batch_shift_labels(
    batch: dict[str, Any], cu: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The row's next-token targets ``[T]`` on ``device``: the collated ``shift_labels`` (an SP
    rank's slice) when the batch has them, else ``labels`` shifted within each segment of ``cu``."""
    if "shift_labels" in batch:
        return batch["shift_labels"].to(device, non_blocking=True).reshape(-1)
    return shift_labels_packed(batch["labels"].to(device).reshape(-1), cu)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait: a CPU tensor bound for CUDA goes through
    pinned memory with a non-blocking copy (a pageable source would synchronise the stream)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
