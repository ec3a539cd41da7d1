"""Torch variant of :func:`lmms_pack.collate_packed` (needs ``pip install 'lmms-pack[torch]'``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmms_pack._collate import collate_packed

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised in the wheel test's torch-free venv
    raise ImportError(
        "lmms_pack.torch needs PyTorch, which lmms-pack does not install by default: "
        "pip install 'lmms-pack[torch]' (the `torch` extra)"
    ) from e

__all__ = ["collate_packed_torch"]


def collate_packed_torch(samples: Sequence[Mapping[str, Any]], *args: Any, **kwargs: Any) -> dict:
    """:func:`lmms_pack.collate_packed` (same arguments) with CPU torch tensors (int64;
    ``cu_seqlens`` int32).

    Samples may hold numpy arrays, lists or CPU tensors. The tensors share memory with the
    freshly built numpy arrays (no copy); ints stay Python ints.
    """
    row = collate_packed(samples, *args, **kwargs)
    return {
        k: torch.from_numpy(v) if hasattr(v, "__array_interface__") else v for k, v in row.items()
    }
