"""lmms-kernels: varlen attention backends, fused linear cross-entropy, scoped Liger patching."""

from ._attention import BACKENDS, available_backends, resolve_backend, varlen_attention
from ._flce import fused_linear_cross_entropy
from ._hf import register_varlen_attention

__all__ = [
    "BACKENDS",
    "available_backends",
    "fused_linear_cross_entropy",
    "register_varlen_attention",
    "resolve_backend",
    "varlen_attention",
]
