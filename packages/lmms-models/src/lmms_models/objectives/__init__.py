"""Training objectives, a choice separate from the model family.

``get_objective("causal_lm")`` (the default) or ``get_objective("masked_diffusion", mask_token_id=...)``
returns an :class:`Objective` whose :meth:`~Objective.loss` turns ``(spec, model, batch, context)``
into :class:`ObjectiveOutput` ``(loss_sum, count, metrics)``. New objectives register with
:func:`register_objective` and are imported here once. Masked diffusion: docs/diffusion-lm.md.
"""

from ._base import (
    CAPABILITIES,
    OBJECTIVE_REGISTRY,
    Objective,
    ObjectiveContext,
    ObjectiveOutput,
    get_objective,
    list_objectives,
    register_objective,
)
from .causal_lm import CausalLM
from .ce_flow_matching import CeFlowMatching, CeFlowMatchingOptions
from .diffusion_sampler import SampleResult, diffusion_generate
from .dpo import DPO, DPOOptions, dpo_pair_losses
from .flow_matching import FlowMatching
from .masked_diffusion import (
    MaskedDiffusion,
    MaskedDiffusionOptions,
    draw_masks,
    make_bidirectional,
)

__all__ = [
    "CAPABILITIES",
    "DPO",
    "OBJECTIVE_REGISTRY",
    "CausalLM",
    "CeFlowMatching",
    "CeFlowMatchingOptions",
    "DPOOptions",
    "FlowMatching",
    "MaskedDiffusion",
    "MaskedDiffusionOptions",
    "Objective",
    "ObjectiveContext",
    "ObjectiveOutput",
    "SampleResult",
    "diffusion_generate",
    "dpo_pair_losses",
    "draw_masks",
    "get_objective",
    "list_objectives",
    "make_bidirectional",
    "register_objective",
]
