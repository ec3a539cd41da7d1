"""The per-micro-batch forward the loop calls: `(model, batch) -> (loss_sum, n_tokens)`.

Wraps the model spec's packed forward with three run-time concerns the spec does not own:

- **FSDP2 root unit.** The spec calls the *base* model (`model.model`) so that no `[T, vocab]`
  logits are built; FSDP2's root hooks, which gather the root unit's parameters (final norm,
  LM head, vision merger) and schedule their gradient reduction, only run when the root module
  itself is called. So the step is run *through* the root: `model(...)` with the instance's
  `forward` temporarily set to the packed forward.
- **Ulysses SP.** With `sp_ulysses_degree > 1` the text decoder's inputs are sliced per rank
  (`lmms_parallel.SequenceParallel`), the labels are sliced to match and the loss sums are
  summed over the SP group (`sp_reduce_loss`, identity backward).
- **Vision participation.** Under FSDP a rank whose pack has no image still runs the (sharded)
  vision tower on a dummy image, where its peers run theirs (`lmms_parallel.VisionParticipation`),
  so that its collectives stay in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmms_train._dist import DistEnv

__all__ = ["call_through_root", "make_forward"]

Forward = Callable[[nn.Module, dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]


def call_through_root(model: nn.Module, fn: Callable[[], Any]) -> Any:
    """Run `fn()` as `model`'s forward, so module hooks (FSDP2's root unit) fire around it."""
    model.forward = lambda *_a, **_k: fn()  # instance attribute shadows the class method
    try:
        # A keyword, not `model()`: FSDP2 in torch <= 2.11 indexes its moved inputs on CUDA and
        # fails (IndexError) when a root is called with no arguments at all.
        return model(lmms_root_call=True)
    finally:
        del model.forward


def make_forward(
    spec: Any, model: nn.Module, env: DistEnv, *, loss_backend: str = "auto"
) -> Forward:
    """The forward for this run's layout (plain, FSDP, SP); `loss_backend`: the fused linear
    cross-entropy's (`lmms_kernels.fused_linear_cross_entropy`)."""
    group = None
    tower = spec.vision_tower(model) if env.distributed else None
    if tower is not None:  # before SequenceParallel on the same module (lmms_parallel's order)
        from lmms_parallel import VisionParticipation

        def dummy() -> dict[str, Any]:
            return spec.dummy_vision_inputs(model, env.device)

        VisionParticipation(spec.sp_slice_module(model), tower, dummy).install()
    if env.sp > 1:
        from lmms_parallel import SequenceParallel, sp_group

        group = sp_group(env.mesh)
        SequenceParallel(spec.sp_slice_module(model), group).install()

    # No explicit ensure_vision_participation here: the hook above runs the dummy where the
    # peers run the tower; a call before the forward would put its all-gathers first.
    def packed(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return spec.packed_forward(model, batch, sp_group=group, loss_backend=loss_backend)

    def forward(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return call_through_root(model, lambda: packed(model, batch))

    return forward
