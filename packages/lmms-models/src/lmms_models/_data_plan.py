"""A family's data plan: how its records become training rows (DESIGN.md, "One data plan").

:meth:`lmms_models.ModelSpec.data_plan` returns one of three plans, each a small frozen
description with the family-side pieces it needs (computed from the model config):

* :class:`TokenRows` (the default): records -> the lmms-data processor of the family's
  ``processor_family`` (with ``processor_options``) -> samples of text/media tokens -> packed rows.
* :class:`ModelPackedRows`: the same processor and packer, then the family's own last packing
  step on the host (``finish(row, pad_to=)``; BAGEL: rows of parts -> its packed row).
* :class:`LatentBatches`: media or precomputed latents -> bucketed latent batches
  (diffusion transformers); ``tokens_fn(shape)`` the transformer tokens of one sample,
  ``num_classes`` the range of class labels (None: no class condition).

lmms-models does not import lmms-data (DESIGN.md, "Dependencies flow one way"), so a plan says
*what* the rows are and lmms-train holds one implementation per plan class (reader, loader,
validation rows, ``check-data``), keyed by the class (docs/contracts.md, "Data plans").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DataPlan", "LatentBatches", "ModelPackedRows", "TokenRows"]


@dataclass(frozen=True, kw_only=True)
class DataPlan:
    """Base of the data plans (see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class TokenRows(DataPlan):
    """Text/media token samples packed by length. ``processor_options``: processor options the
    model config fixes (under the user's ``dataset_config.extra``, which wins)."""

    processor_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ModelPackedRows(TokenRows):
    """Token rows the family finishes packing itself: ``finish(row, pad_to=None)`` turns each
    loader row into the row its forward takes (host tensors, stateless: the loader's state stays
    the resume point; ``pad_to``: pad every row to that many tokens, one shape for compiled
    attention). Its ``labels`` are next-token targets and ``num_fm_tokens`` counts the noised
    latent tokens (what ``check-data`` reports as supervised)."""

    finish: Callable[..., dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class LatentBatches(DataPlan):
    """Bucketed latent batches (docs/contracts.md, "Latent batches")."""

    tokens_fn: Callable[[tuple[int, ...]], int]
    num_classes: int | None = None
