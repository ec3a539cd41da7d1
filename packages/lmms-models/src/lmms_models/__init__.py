"""lmms-models: model specs for packed multimodal training on upstream transformers models.

A spec builds the upstream model (from a config dict, a local pretrained folder, or on the meta
device), runs the packed ("rmpad") forward with lmms varlen attention and a fused linear
cross-entropy, and tells lmms-parallel which blocks to shard and which module to slice for
sequence parallel. Adding a family is one folder under ``families/`` (docs/adding-a-model.md).
"""

from ._attention import UPSTREAM_BACKENDS, set_attention, text_attention_kwargs
from ._capabilities import (
    GeneratesLatents,
    HasExperts,
    MixedGeneration,
    OwnTestSamples,
    RenderRequest,
    Renders,
    TokenTypes,
)
from ._data_plan import DataPlan, LatentBatches, ModelPackedRows, TokenRows
from ._diffusion import DiffusionSpec, attach_encoder, get_encoder, place_encoders
from ._flops import attention_flops
from ._lora import LoraHandle, LoraOptions, apply_lora, quantize_base_nf4
from ._memory import TowerShape, decoder_tower
from ._moe import EXPERTS_EP_PLAN, ExpertLoadMeter, MoESpecMixin, expert_load_meter
from ._patch_embed import PatchEmbedHandle, linear_patch_embed
from ._registry import (
    MODEL_REGISTRY,
    FamilyUnavailableError,
    get_model_spec,
    list_models,
    register_model,
    unavailable_models,
)
from ._spec import IGNORE_INDEX, ModelSpec, shift_labels_packed, to_device
from ._vision_split import VisionSplitPlan
from ._vl import TINY_TOKEN_IDS, QwenVLSpec

__all__ = [
    "EXPERTS_EP_PLAN",
    "IGNORE_INDEX",
    "MODEL_REGISTRY",
    "TINY_TOKEN_IDS",
    "UPSTREAM_BACKENDS",
    "DataPlan",
    "DiffusionSpec",
    "ExpertLoadMeter",
    "FamilyUnavailableError",
    "GeneratesLatents",
    "HasExperts",
    "LatentBatches",
    "LoraHandle",
    "LoraOptions",
    "MixedGeneration",
    "MoESpecMixin",
    "ModelPackedRows",
    "ModelSpec",
    "OwnTestSamples",
    "PatchEmbedHandle",
    "QwenVLSpec",
    "RenderRequest",
    "Renders",
    "TokenRows",
    "TokenTypes",
    "TowerShape",
    "VisionSplitPlan",
    "apply_lora",
    "attach_encoder",
    "attention_flops",
    "decoder_tower",
    "expert_load_meter",
    "get_encoder",
    "get_model_spec",
    "linear_patch_embed",
    "list_models",
    "place_encoders",
    "quantize_base_nf4",
    "register_model",
    "set_attention",
    "shift_labels_packed",
    "text_attention_kwargs",
    "to_device",
    "unavailable_models",
]
