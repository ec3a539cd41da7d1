"""Tensor-parallel styles (DTensor ``parallelize_module``) and the one style DTensor lacks.

``"colwise"`` / ``"rowwise"``: torch's ``ColwiseParallel`` / ``RowwiseParallel`` with local
outputs (Megatron's pairs: q/k/v and gate/up column-wise, o and down row-wise; the row-wise output
is all-reduced, so everything between blocks stays replicated on the TP group and upstream code
reshapes the local heads with its ``-1``).

``"sum_grad"``: a module that stays replicated but sees only this rank's slice of the activations
(Qwen3's per-head ``q_norm`` / ``k_norm``, applied to the local heads): forward unchanged, its
parameters' gradients summed over the TP group in backward (each rank holds its heads' part).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SumGradOverGroup", "tp_style"]


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumGradOverGroup:
    """The ``"sum_grad"`` style: the module's own parameters reach its forward through an identity
    whose backward sums their gradient over ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def apply(self, module: nn.Module) -> nn.Module:
        group = self.group
        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        if not names:
            raise ValueError(f"'sum_grad' on {type(module).__name__}: it has no parameter")
        cls_forward = type(module).forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            saved = {n: self._parameters[n] for n in names}
            try:
                for n, p in saved.items():
                    self._parameters[n] = _SumGrad.apply(p, group)  # type: ignore[assignment]
                return cls_forward(self, *args, **kwargs)
            finally:
                self._parameters.update(saved)

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return module


def tp_style(name: str) -> Any:
    """A DTensor ``ParallelStyle`` for the built-in TP style names."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel(use_local_output=True)
    if name == "rowwise":
        return RowwiseParallel(use_local_output=True)
    raise KeyError(name)
