"""Qwen3-VL's sequence-parallel TP style: ``sp_deepstack`` (moved here from lmms-parallel, which
applies it generically: ``apply_tp(..., styles=spec.plan_styles())``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmms_parallel import seq_rows, sum_grad

__all__ = ["SeqShardedDeepstack"]


class SeqShardedDeepstack:
    """``sp_deepstack`` (on a Qwen3-VL-style text decoder: the plan's root, pattern ``""``), the
    family's own TP style (:meth:`Qwen3VLSpec.plan_styles`, applied by lmms_parallel's
    ``apply_tp``).

    The decoder adds deepstack features to its hidden states after its first layers
    (``self._deepstack_process(hidden, where, embeds)`` in upstream's layer loop), at the visual
    positions of the whole row. Under this plan the residual stream is already split there
    (``sp_scatter_input`` on layer 0, ``rowwise_sp`` outputs): ``hidden`` is ``[1, T_r, H]``,
    this rank's rows ``[lo, hi)``. This style sets the instance's ``_deepstack_process`` to one
    that adds only the features of visual positions inside ``[lo, hi)``, at their local rows:

    * ``where`` a boolean ``[B, T]`` mask (upstream's merge): its columns ``[lo, hi)`` and the
      matching rows of ``embeds`` (mask order), handed to upstream's own method;
    * ``where`` ``[N]`` long positions (lmms_models' host merge, ``takes_positions``): added by
      ``index_add`` into a spare-row buffer (positions outside ``[lo, hi)`` land in the spare row),
      so no position is read on the host; the same single addition per visual row as upstream.

    ``embeds`` are replicated on the TP group (the vision tower is): each rank's backward fills
    its rows' gradient, the identity in front of the slicing sums it over TP (``sum_grad``), so
    the tower gets the whole gradient on every rank, as the embeddings get it through
    ``sp_scatter_input``.
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def apply(self, module: nn.Module) -> nn.Module:
        upstream = getattr(type(module), "_deepstack_process", None)
        if upstream is None:
            raise TypeError(
                f"'sp_deepstack' on {type(module).__name__}: it has no _deepstack_process "
                "(Qwen3-VL's deepstack); the style applies to such a text decoder"
            )
        group = self.group

        def process(
            hidden: torch.Tensor, where: torch.Tensor, embeds: torch.Tensor
        ) -> torch.Tensor:
            lo, hi = seq_rows(group)
            if hidden.shape[1] != hi - lo:
                raise RuntimeError(
                    f"sp_deepstack: hidden states of {hidden.shape[1]} rows, this rank's slice of "
                    f"the sequence has {hi - lo}: the residual stream is not split as the plan's "
                    "sp_scatter_input split it"
                )
            embeds = sum_grad(embeds.to(hidden.device, hidden.dtype), group)  # [N, H]
            where = where.to(hidden.device)
            if where.dtype == torch.bool:  # [B, T]: row-major mask order of embeds
                order = (where.reshape(-1).cumsum(0) - 1).view_as(where)  # [B, T]
                local = where[:, lo:hi]
                rows = embeds.index_select(0, order[:, lo:hi][local])  # [n, H] (host read)
                return upstream(module, hidden, local, rows)
            # where [N] positions in the row, hidden [1, T_r, H]; outside [lo, hi) -> spare row
            n = hi - lo
            inside = (where >= lo) & (where < hi)
            idx = torch.where(inside, where - lo, torch.full_like(where, n))  # [N]
            buf = hidden.new_zeros(hidden.shape[0], n + 1, hidden.shape[2])
            return hidden + buf.index_add(1, idx, embeds[None])[:, :n]

        # deepstack_by_index (this family) leaves an adder so marked in place (it takes positions)
        process.takes_positions = True  # type: ignore[attr-defined]
        module._deepstack_process = process  # type: ignore[method-assign]
        return module
