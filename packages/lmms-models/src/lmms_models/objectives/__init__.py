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
from .dllm_checkpoints import (
    DLLM_LAYOUTS,
    DllmCheckpoint,
    DllmLayout,
    export_dream,
    load_dllm,
    read_layout,
)
from .dpo import DPO, DPOOptions, dpo_pair_losses
from .flow_matching import FlowMatching
from .llada_layout import LLADA_MASK_TOKEN_ID, export_llada
from .masked_diffusion import (
    MaskedDiffusion,
    MaskedDiffusionOptions,
    draw_masks,
    make_bidirectional,
)

__all__ = [
    "CAPABILITIES",
    "DLLM_LAYOUTS",
    "DPO",
    "LLADA_MASK_TOKEN_ID",
    "OBJECTIVE_REGISTRY",
    "CausalLM",
    "CeFlowMatching",
    "CeFlowMatchingOptions",
    "DPOOptions",
    "DllmCheckpoint",
    "DllmLayout",
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
    "export_dream",
    "export_llada",
    "get_objective",
    "list_objectives",
    "load_dllm",
    "make_bidirectional",
    "read_layout",
    "register_objective",
]
