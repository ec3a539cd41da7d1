"""Activation checkpointing per block: ``none``, ``full`` or ``selective``.

- ``full``: a block keeps only its input; everything inside is recomputed in backward
  (least memory, ~1/3 more compute).
- ``selective``: inside each block, outputs of matmuls and attention are saved and cheap
  element-wise ops (norms, activations, rotary) are recomputed: most of full's memory saving on
  the element-wise activations at a few percent of compute (op-level selective checkpointing).

The block's ``forward`` is replaced on the instance (not the class, not a wrapper module), so
parameter names and state-dict keys do not change; the returned handle restores it.
Apply before FSDP (the FSDP hooks wrap ``__call__``, not ``forward``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ACHandle", "apply_activation_checkpointing"]

_MODES = ("none", "full", "selective")


@dataclass(kw_only=True, slots=True)
class ACHandle:
    """Restores the original ``forward`` of every wrapped block on :meth:`remove`."""

    blocks: list[nn.Module] = field(default_factory=list)

    def remove(self) -> None:
        for block in self.blocks:
            if "forward" in block.__dict__:
                del block.__dict__["forward"]
        self.blocks.clear()


def _save_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ):
        op = getattr(aten, name, None)
        if op is not None:
            ops.add(op.default)
    return ops


def _selective_context() -> Callable:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _save_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def select_fraction(blocks: Sequence[nn.Module], fraction: float) -> list[nn.Module]:
    """``fraction`` of ``blocks``, spread evenly: 0.5 takes every other block (the 2nd, 4th, ...),
    0.25 every fourth, 1.0 all, 0.0 none.

    Spread rather than the first k: the memory saved is the same (each checkpointed block frees
    its saved activations wherever it sits), and the recompute is spread over backward instead
    of bunched at its end.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"activation checkpointing fraction must be in [0, 1], got {fraction}")
    return [
        b for i, b in enumerate(blocks) if math.floor((i + 1) * fraction) > math.floor(i * fraction)
    ]


def apply_activation_checkpointing(
    blocks: Sequence[nn.Module], mode: str = "full", *, fraction: float = 1.0
) -> ACHandle:
    """Checkpoint ``fraction`` of ``blocks`` (transformer blocks, vision blocks), spread evenly
    (:func:`select_fraction`), according to ``mode``; ``handle.blocks`` are the ones wrapped."""
    if mode not in _MODES:
        raise ValueError(f"activation checkpointing mode must be one of {_MODES}, got {mode!r}")
    chosen = select_fraction(blocks, fraction)
    handle = ACHandle()
    if mode == "none":
        return handle
    context_fn = _selective_context() if mode == "selective" else None
    for block in chosen:
        if "forward" in block.__dict__:
            raise RuntimeError(
                f"{type(block).__name__} already has an instance forward (checkpointed twice?)"
            )
        original = block.forward

        def forward(*args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_original, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward
        handle.blocks.append(block)
    return handle
