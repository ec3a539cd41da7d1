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
  vision tower on a dummy image, where its peers run theirs, so that its collectives stay in step:
  the spec's `install_participation` (default `lmms_parallel.VisionParticipation`; the Omni
  thinkers run both towers in one order).
- **Objective.** The loss is the run's objective (`lmms_models.objectives`, `model_config.
  objective`): `causal_lm` is the spec's packed forward; others (masked diffusion, flow matching)
  put their own loss on the spec's hidden states. The forward is an `ObjectiveForward`: the loop
  tells it the step (`begin_step`, for the objective's seeded draws), asks it for each pack's
  normaliser (`count_tokens`) and takes the step's summed metrics (`take_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from lmms_train._dist import DistEnv

__all__ = ["ObjectiveForward", "call_through_root", "make_forward"]

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


class ObjectiveForward:
    """`(model, batch) -> (loss_sum, count)` through the run's objective, plus its bookkeeping.

    Metrics (`ObjectiveOutput.metrics`: `{name: (numerator, denominator)}` device scalars) are
    summed over the step's training micro-batches on the device (nothing is read on the host
    here); forwards without gradients (validation) add nothing to them.
    """

    def __init__(
        self,
        fn: Callable[[nn.Module, dict[str, Any], Any], Any],
        objective: Any,
        seed: int,
        reference: Any = None,
    ):
        self._fn, self.objective, self.seed = fn, objective, seed
        self.reference = reference  # ObjectiveContext.reference (LoRA: the adapters off)
        self.step = 0
        self._micro = 0
        self._metrics: dict[str, list[torch.Tensor]] = {}

    def begin_step(self, step: int) -> None:
        """The optimizer step (1-based) the next micro-batches belong to."""
        self.step, self._micro = step, 0

    def count_tokens(self, batch: dict[str, Any]) -> int:
        """The pack's share of the global normaliser (host-side)."""
        return self.objective.count_tokens(batch)

    def __call__(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from lmms_models.objectives import ObjectiveContext

        ctx = ObjectiveContext(
            seed=self.seed, step=self.step, micro_batch=self._micro, reference=self.reference
        )
        out = self._fn(model, batch, ctx)
        self._micro += 1
        if torch.is_grad_enabled():
            for name, (num, den) in out.metrics.items():
                acc = self._metrics.setdefault(
                    name, [torch.zeros((), dtype=torch.float64, device=num.device)] * 2
                )
                self._metrics[name] = [
                    acc[0] + num.detach().double(),
                    acc[1] + den.detach().double(),
                ]
        return out.loss_sum, out.count

    def take_metrics(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The step's metric sums so far (this rank), and start afresh."""
        out = {k: (v[0], v[1]) for k, v in self._metrics.items()}
        self._metrics = {}
        return out


def make_forward(
    spec: Any,
    model: nn.Module,
    env: DistEnv,
    *,
    loss_backend: str = "auto",
    objective: Any = None,
    seed: int = 0,
    split_vision: bool = True,
    reference: Any = None,
) -> ObjectiveForward:
    """The forward for this run's layout (plain, FSDP, SP); `loss_backend`: the fused linear
    cross-entropy's (`lmms_kernels.fused_linear_cross_entropy`); `objective`: an
    `lmms_models.objectives.Objective` (default `causal_lm`), `seed` its draws' seed;
    `split_vision`: under SP, share the vision tower's work over the group (SplitVision);
    `reference`: the objective's reference policy context (`ObjectiveContext.reference`)."""
    if objective is None:
        from lmms_models.objectives import get_objective

        objective = get_objective("causal_lm")
    group = None
    tower = spec.vision_tower(model) if env.distributed else None
    if env.distributed:  # before SequenceParallel on the same module (lmms_parallel's order)
        spec.install_participation(model, env.device)  # default: VisionParticipation
    if env.sp > 1:
        from lmms_parallel import sp_group

        group = sp_group(env.mesh)
        spec.install_sp(model, group)  # default: SequenceParallel on spec.sp_slice_module
        # each SP rank encodes a share of the media, for families that say how to split their
        # tower's work (audio towers do not: their output rows are not proportional to input
        # rows; the tower then runs whole on every SP rank, as before the split)
        if split_vision and tower is not None and spec.splits_vision():
            from lmms_parallel import SplitVision

            SplitVision(tower, partial(spec.vision_split_plan, model), group).install()

    # No explicit ensure_vision_participation here: the hook above runs the dummy where the
    # peers run the tower; a call before the forward would put its all-gathers first.
    def forward(model: nn.Module, batch: dict[str, Any], ctx: Any) -> Any:
        ctx.sp_group, ctx.loss_backend = group, loss_backend
        return call_through_root(model, lambda: objective.loss(spec, model, batch, ctx))

    return ObjectiveForward(forward, objective, seed, reference)
