"""lmms-kernels: varlen attention backends, fused linear cross-entropy, scoped Liger patching."""

from . import (
    _attention_ops,  # noqa: F401  (registers the lmms_kernels:: custom ops)
    _linear_ops,  # noqa: F401  (registers the linear-attention custom ops)
)
from ._attention import BACKENDS, available_backends, resolve_backend, varlen_attention
from ._compile import (
    CompileHandle,
    compile_blocks,
    compile_counts,
    describe_new_fa4_kernels,
    fa4_kernel_keys,
    fa4_variants,
)
from ._flce import fused_linear_cross_entropy, labelled_rows
from ._hf import register_varlen_attention
from ._liger import LigerPlan, PatchHandle, apply_liger
from ._linear_attention import (
    LINEAR_BACKENDS,
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    gated_rms_norm,
    resolve_linear_backend,
)
from ._moe import (
    EXPERTS_BACKENDS,
    expert_counts,
    experts_forward,
    grouped_experts,
    grouped_mm_available,
    register_experts,
)
from ._warmup import WARM_COUNTS, attention_calls, warm_attention

__all__ = [
    "BACKENDS",
    "EXPERTS_BACKENDS",
    "LINEAR_BACKENDS",
    "WARM_COUNTS",
    "CompileHandle",
    "LigerPlan",
    "PatchHandle",
    "apply_liger",
    "attention_calls",
    "available_backends",
    "causal_conv1d_varlen",
    "compile_blocks",
    "compile_counts",
    "describe_new_fa4_kernels",
    "expert_counts",
    "experts_forward",
    "fa4_kernel_keys",
    "fa4_variants",
    "fused_linear_cross_entropy",
    "gated_delta_rule_varlen",
    "gated_rms_norm",
    "grouped_experts",
    "grouped_mm_available",
    "labelled_rows",
    "register_experts",
    "register_varlen_attention",
    "resolve_backend",
    "resolve_linear_backend",
    "varlen_attention",
    "warm_attention",
]
