"""The Qwen-VL patch embedding as the matrix product it is.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL embed each ``temporal × patch × patch`` RGB patch with a
``Conv3d`` whose stride equals its kernel: every output position sees exactly one patch, so the
convolution is ``patches [N, C·T·P·P] @ weightᵀ [C·T·P·P, D] (+ bias)``. Upstream runs it through
cuDNN, which picks (and may build) an engine for every new patch count, and every pack has a new
one. :func:`linear_patch_embed` replaces the module's ``forward`` (not its parameters: the state
dict, checkpoints and FSDP sharding are unchanged) with one GEMM.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PatchEmbedHandle", "linear_patch_embed"]


@dataclass(kw_only=True, slots=True)
class PatchEmbedHandle:
    """Undo record of :func:`linear_patch_embed` (``remove()`` restores the upstream forward)."""

    module: nn.Module | None = None

    def remove(self) -> None:
        if self.module is not None:
            del self.module.forward
            self.module = None


def _one_window_per_patch(proj: nn.Module) -> bool:
    return (
        isinstance(proj, nn.Conv3d)
        and tuple(proj.stride) == tuple(proj.kernel_size)
        and tuple(proj.padding) == (0, 0, 0)
        and tuple(proj.dilation) == (1, 1, 1)
        and proj.groups == 1
        and proj.padding_mode == "zeros"
    )


def _linear_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.proj.weight  # [D, C, T, P, P]; the patches arrive flattened in (C, T, P, P) order
    patches = hidden_states.reshape(-1, weight.shape[1:].numel()).to(weight.dtype)
    return F.linear(patches, weight.reshape(weight.size(0), -1), self.proj.bias)


def linear_patch_embed(tower: nn.Module | None) -> PatchEmbedHandle:
    """Run ``tower.patch_embed`` as one GEMM (see the module doc). A tower without a
    one-window-per-patch ``Conv3d`` (or no tower) is left as it is: the handle is then empty."""
    embed = getattr(tower, "patch_embed", None)
    if embed is None or not _one_window_per_patch(getattr(embed, "proj", None)):
        return PatchEmbedHandle()
    embed.forward = types.MethodType(_linear_forward, embed)
    return PatchEmbedHandle(module=embed)
