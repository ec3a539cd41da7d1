"""lmms-pack: streaming and offline sequence packing with padding-free collation (numpy only).

Public API::

    StreamPacker(capacity, strategy="first_fit", max_open_bins=8, overlong="error",
                 *, budget_capacity=None, truncate_fn=None)
        .pack(items, length=None, *, budget=None, flush=True) -> Iterator[list[item]]
        .stats -> PackStats   .state_dict() / .load_state_dict(state)   .consumed
    pack_lengths(lengths, capacity, strategy="ffd", *, max_open_bins=8, overlong="error",
                 budgets=None, budget_capacity=None) -> PackResult (list of index lists)
    collate_packed(samples, pad_to_multiple_of=None, pad_token_id=0, ignore_index=-100) -> dict
    truncate_sample(sample, length) -> dict

``lmms_pack.torch.collate_packed_torch`` is the torch variant (needs the ``torch`` extra); it
is imported only when asked for, so importing ``lmms_pack`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from lmms_pack._collate import IGNORE_INDEX, collate_packed, truncate_sample
from lmms_pack._offline import OFFLINE_STRATEGIES, STRATEGIES, PackResult, pack_lengths
from lmms_pack._stream import OVERLONG_POLICIES, STREAM_STRATEGIES, PackStats, StreamPacker

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "OFFLINE_STRATEGIES",
    "OVERLONG_POLICIES",
    "STRATEGIES",
    "STREAM_STRATEGIES",
    "PackResult",
    "PackStats",
    "StreamPacker",
    "__version__",
    "collate_packed",
    "pack_lengths",
    "truncate_sample",
]


def __getattr__(name: str) -> Any:
    if name == "torch":  # `lmms_pack.torch` without an explicit import of the submodule
        return importlib.import_module("lmms_pack.torch")
    raise AttributeError(f"module 'lmms_pack' has no attribute {name!r}")
