"""Training objectives: how one packed micro-batch becomes ``(loss_sum, count, metrics)``.

An objective is a choice separate from the model family (DESIGN.md, "Growing in breadth"): the
same Qwen3 decoder trains as a causal LM (next-token cross-entropy) or as a masked-diffusion LM
(bidirectional, 1/t-weighted), a diffusion transformer trains with flow matching. The trainer
knows objectives only through this interface and normalises every one the same way: the sum of
``loss_sum`` over the global batch (every micro-batch, every data-parallel rank) divided by the
global sum of :meth:`Objective.count_tokens` (read on the host before the step).

Registry (STYLE.md #5): :func:`register_objective` fills :data:`OBJECTIVE_REGISTRY`, refusing
duplicates; :func:`get_objective` builds one from its options and lists the registered names when
the name is unknown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from .._registry import unknown_name

__all__ = [
    "CAPABILITIES",
    "OBJECTIVE_REGISTRY",
    "Objective",
    "ObjectiveContext",
    "ObjectiveOutput",
    "get_objective",
    "list_objectives",
    "register_objective",
]

OBJECTIVE_REGISTRY: dict[str, type[Objective]] = {}

#: Capabilities an objective may require of a family (``Objective.requires``) and a family
#: states (``ModelSpec.objective_capabilities``), with what each means.
CAPABILITIES: dict[str, str] = {
    "token_lm": "a language model (a vocabulary and an LM head over packed token rows)",
    "bidirectional_text": "text attention that can be made bidirectional (softmax attention)",
    "latent_denoiser": "a denoiser of latents (a diffusion transformer)",
    "ce_flow_heads": "text cross-entropy and flow matching on image latents in one forward",
}

_O = TypeVar("_O", bound=type)


@dataclass(kw_only=True, slots=True)
class ObjectiveContext:
    """Run-time facts an objective may need besides the model and the batch.

    * ``seed`` / ``step`` / ``micro_batch``: the randomness of a stochastic objective (noise
      levels, masks) must be a function of these and of the samples themselves, so that a resumed
      run draws the same values bit for bit and a layout change (FSDP ranks, SP degree, packing)
      does not change what a sample sees.
    * ``sp_group``: the Ulysses SP group (None without SP); the model's decoder then sees this
      rank's slice of the row, and the objective reduces its sums over the group.
    * ``loss_backend``: the fused linear cross-entropy's backend
      (``lmms_kernels.fused_linear_cross_entropy``).
    * ``reference``: a context factory under which the model computes the frozen reference
      policy (LoRA: ``lmms_models.LoraHandle.disabled``, the adapters off), or None: no reference
      (preference objectives then refuse).
    """

    seed: int = 0
    step: int = 0
    micro_batch: int = 0
    sp_group: Any = None
    loss_backend: str = "auto"
    reference: Callable[[], contextlib.AbstractContextManager] | None = None


@dataclass(kw_only=True, slots=True)
class ObjectiveOutput:
    """One micro-batch's result on this rank.

    * ``loss_sum``: fp32 scalar with a gradient; the sum of the (weighted) per-token losses of the
      whole row (already summed over the SP group).
    * ``count``: int64 scalar, this row's normaliser (the host-side :meth:`Objective.count_tokens`
      of the same row; kept for callers that normalise per row, e.g. tests).
    * ``metrics``: ``{name: (numerator, denominator)}`` device scalars (no gradient) that sum over
      micro-batches and ranks; the logged value is ``sum(numerator) / sum(denominator)``.
    """

    loss_sum: torch.Tensor
    count: torch.Tensor
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class Objective:
    """Base class of the objectives. A subclass sets ``name`` (by :func:`register_objective`),
    optionally an ``Options`` dataclass (its constructor keywords, documented there), and
    implements :meth:`loss`.

    Hooks, in the order the trainer calls them:

    * :meth:`prepare_model` once after the model is built, before any parallelism is applied
      (e.g. make the decoder's attention bidirectional);
    * :meth:`count_tokens` per micro-batch on the host (the global normaliser is their sum);
    * :meth:`loss` per micro-batch, inside the trainer's forward (FSDP2's root unit around it).

    Objectives keep no state across steps: their randomness is a function of
    :class:`ObjectiveContext` and the batch, so checkpoints hold nothing of them and a resumed run
    redraws the same values.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type | None] = None
    #: What the objective needs of a model family: names from :data:`CAPABILITIES` that the
    #: family's ``ModelSpec.objective_capabilities()`` must all include (checked by
    #: :meth:`family_problem` before the model is built).
    requires: ClassVar[frozenset[str]] = frozenset({"token_lm"})
    #: The objective trains on preference pairs (lmms_data's ``dataset_type: preference``: each
    #: sample a chosen and a rejected document) against a frozen reference policy
    #: (``ObjectiveContext.reference``); the trainer checks both at start-up.
    preference: ClassVar[bool] = False
    #: The loss is next-token cross-entropy through the LM head read only at the rows whose
    #: ``shift_labels`` are set: ``trainer_args.loss_rows: labelled`` may run the head on those
    #: rows alone (the pack's ``loss_rows``).
    labelled_rows: ClassVar[bool] = False
    #: The loss takes the LM head through the fused cross-entropy that accepts a
    #: vocabulary-parallel head: under TP the trainer applies the family's ``tp_head_plan``
    #: (never [T, vocab] on one rank); otherwise the head stays replicated.
    vocab_parallel_head: ClassVar[bool] = False
    #: The ``shift`` option (do positions predict the next token?) defaults to what a pretrained
    #: folder's checkpoint layout says (``lmms_models.layouts.read_layout``: Dream's is shifted).
    layout_shift: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        if self.Options is None:
            if options:
                raise TypeError(f"objective {self.name!r} takes no options, got {sorted(options)}")
            self.options: Any = None
            return
        known = {f.name for f in dataclasses.fields(self.Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            hints = [
                f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, known, 1))
                else repr(u)
                for u in unknown
            ]  # fmt: skip
            raise TypeError(
                f"objective {self.name!r}: unknown option(s) {', '.join(hints)}; "
                f"options: {', '.join(sorted(known))}"
            )
        self.options = self.Options(**options)

    @classmethod
    def family_problem(cls, spec: Any) -> str | None:
        """Why this objective cannot train ``spec``'s family (None: it can), from what each
        declares (:attr:`requires`, ``spec.objective_capabilities()``)."""
        missing = sorted(cls.requires - spec.objective_capabilities())
        if not missing:
            return None
        needs = " and ".join(CAPABILITIES.get(m, m) for m in missing)
        return f"objective {cls.name!r} needs {needs}, which {spec.name} does not have"

    # -------------------------------------------------------------- hooks
    def prepare_model(self, spec: Any, model: nn.Module) -> None:
        """Adapt a freshly built model (single device, before parallelism). Default: nothing."""

    def needs_reference(self) -> bool:
        """The objective reads ``ObjectiveContext.reference`` (a frozen reference policy computed
        by the model itself: LoRA with its adapters off). Default: no."""
        return False

    def count_tokens(self, batch: dict[str, Any]) -> int:
        """This row's share of the global normaliser, read on the host: the collator's
        ``num_loss_tokens`` (supervised tokens) by default."""
        return int(batch["num_loss_tokens"])

    def loss(
        self, spec: Any, model: nn.Module, batch: dict[str, Any], ctx: ObjectiveContext
    ) -> ObjectiveOutput:
        raise NotImplementedError(f"objective {self.name!r} defines no loss")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


def register_objective(name: str) -> Callable[[_O], _O]:
    """Class decorator: register an :class:`Objective` subclass under ``name`` (no duplicates)."""

    def deco(cls: _O) -> _O:
        if name in OBJECTIVE_REGISTRY:
            raise ValueError(
                f"objective {name!r} is already registered (by {OBJECTIVE_REGISTRY[name].__name__})"
            )
        cls.name = name  # type: ignore[attr-defined]
        OBJECTIVE_REGISTRY[name] = cls  # type: ignore[assignment]
        return cls

    return deco


def list_objectives() -> list[str]:
    """Names of the registered objectives, sorted."""
    return sorted(OBJECTIVE_REGISTRY)


def get_objective(name: str, **options: Any) -> Objective:
    """A new objective ``name`` built from ``options``; the error lists what is registered.

    The built-in objectives are registered when :mod:`lmms_models.objectives` is imported (its
    ``__init__`` imports each module, which this module's import already ran).
    """
    try:
        cls = OBJECTIVE_REGISTRY[name]
    except KeyError:
        raise unknown_name("objective", name, OBJECTIVE_REGISTRY) from None
    return cls(**options)
