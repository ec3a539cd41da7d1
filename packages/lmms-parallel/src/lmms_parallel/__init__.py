"""lmms-parallel: device mesh, FSDP2 (or one-device master weights), Ulysses sequence parallel, activation checkpointing, DCP.

Model-agnostic: which modules are blocks, which module to slice for SP, and how to build a dummy
vision input come from the model spec (lmms-models) as data.
"""

from lmms_parallel._ac import ACHandle, apply_activation_checkpointing
from lmms_parallel._checkpoint import Checkpointer
from lmms_parallel._ep import ExpertParallel, ep_local_slice, ep_params
from lmms_parallel._export import export_hf, gather_full_state_dict
from lmms_parallel._fsdp import apply_fsdp, replace_sharded_param
from lmms_parallel._master import MasterWeights
from lmms_parallel._mesh import (
    ExpertMeshes,
    ParallelDims,
    dp_mesh,
    expert_meshes,
    fsdp_mesh,
    sp_group,
    tp_mesh,
)
from lmms_parallel._meta import load_full_state_dict, materialize, meta_init, read_safetensors
from lmms_parallel._norm import clip_grad_norm_
from lmms_parallel._plans import apply_ep, apply_tp, match_plan, register_style, registered_styles
from lmms_parallel._row_sp import gather_row_slices, slice_row
from lmms_parallel._sp_plans import SPContext, SPHandle, apply_sp, sp_replicated_grad
from lmms_parallel._split_vision import SplitVision, VisionSplitPlan
from lmms_parallel._tp import SumGradOverGroup
from lmms_parallel._tp_sp import seq_rows, sum_grad
from lmms_parallel._ulysses import (
    SequenceParallel,
    UlyssesAttention,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    sp_pad_len,
    sp_reduce_loss,
    sp_shard_labels,
)
from lmms_parallel._vision import VisionParticipation, ensure_vision_participation
from lmms_parallel._vision_split import gather_rows, split_contiguous, split_imbalance
from lmms_parallel._vocab_parallel import (
    VocabParallelHead,
    vocab_parallel_cross_entropy,
    vocab_parallel_shard,
)

__all__ = [
    "ACHandle",
    "Checkpointer",
    "ExpertMeshes",
    "ExpertParallel",
    "MasterWeights",
    "ParallelDims",
    "SPContext",
    "SPHandle",
    "SequenceParallel",
    "SplitVision",
    "SumGradOverGroup",
    "UlyssesAttention",
    "VisionParticipation",
    "VisionSplitPlan",
    "VocabParallelHead",
    "all_to_all_heads_to_seq",
    "all_to_all_seq_to_heads",
    "apply_activation_checkpointing",
    "apply_ep",
    "apply_fsdp",
    "apply_sp",
    "apply_tp",
    "clip_grad_norm_",
    "dp_mesh",
    "ensure_vision_participation",
    "ep_local_slice",
    "ep_params",
    "expert_meshes",
    "export_hf",
    "fsdp_mesh",
    "gather_full_state_dict",
    "gather_row_slices",
    "gather_rows",
    "load_full_state_dict",
    "match_plan",
    "materialize",
    "meta_init",
    "read_safetensors",
    "register_style",
    "registered_styles",
    "replace_sharded_param",
    "seq_rows",
    "slice_row",
    "sp_group",
    "sp_pad_len",
    "sp_reduce_loss",
    "sp_replicated_grad",
    "sp_shard_labels",
    "split_contiguous",
    "split_imbalance",
    "sum_grad",
    "tp_mesh",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_shard",
]
