"""lmms-optim: Muon with Triton Newton–Schulz, single-device and distributed over FSDP2.

Depends on torch only; Triton (shipped with CUDA builds of torch) is imported lazily on CUDA.
"""

from ._flat_adamw import flat_adamw_, segment_chunks
from ._groups import DEFAULT_ADAMW_PATTERNS, build_muon_param_groups
from ._lowp_adamw import LowPrecisionAdamW, stochastic_round_
from ._master_adamw import MasterAdamW
from ._master_muon import MasterMuon
from ._muon import Muon, lr_scale
from ._ns import (
    COEFFICIENT_SCHEDULES,
    NSSchedule,
    newton_schulz,
    newton_schulz_reference,
    resolve_schedule,
)

__all__ = [
    "COEFFICIENT_SCHEDULES",
    "DEFAULT_ADAMW_PATTERNS",
    "LowPrecisionAdamW",
    "MasterAdamW",
    "MasterMuon",
    "Muon",
    "NSSchedule",
    "build_muon_param_groups",
    "flat_adamw_",
    "lr_scale",
    "newton_schulz",
    "newton_schulz_reference",
    "resolve_schedule",
    "segment_chunks",
    "stochastic_round_",
]
__version__ = "0.1.0"
