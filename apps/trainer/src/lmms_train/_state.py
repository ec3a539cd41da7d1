"""Resume bookkeeping: the trainer's counters and every RNG, as a weights_only-loadable dict.

Exact resume needs the model, optimizer, scheduler, data position *and* the RNG streams (CPU,
CUDA, Python, NumPy) of every rank; this module owns the last two pieces. Everything is kept as
plain ints/floats/lists and tensors so `torch.load(weights_only=True)` can read it back.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["TrainState", "get_rng_state", "seed_everything", "set_rng_state"]


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Counters that survive a resume (and feed cumulative metrics)."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # global tokens consumed
    samples_seen: int = 0  # global samples consumed
    bad_records: int = 0  # this rank's bad records so far (summed over ranks when logged)
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """Every RNG stream of this process."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` captured (CUDA only when present on both sides)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda = state["torch_cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
