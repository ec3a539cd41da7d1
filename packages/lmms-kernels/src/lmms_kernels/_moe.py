"""Mixture-of-experts experts on grouped GEMMs, dropless, with a plain-torch reference.

Upstream transformers stores the experts of a sparse block as 3-D tensors
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and dispatches the experts' forward
``fn(module, hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`` through its
experts-implementation registry (``config._experts_implementation``). Its default ("eager") loops
over the experts in Python with a host read per expert. The function registered here sorts the
``N·k`` (token, expert) pairs by expert and runs each projection as *one* grouped matmul
(``torch._grouped_mm`` / ``torch.nn.functional.grouped_mm``) over the groups; every token reaches
all of its top-k experts (dropless: no capacity, nothing dropped), and no count is read on the
host.

:func:`grouped_experts` is the piece expert parallelism reuses: rows already grouped by expert
(after an all-to-all) through the experts' two projections. ``backend="loop"`` is the plain-torch
reference (``F.linear`` per expert on host-known splits) the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._flce import _compute_dtype

__all__ = [
    "EXPERTS_BACKENDS",
    "expert_counts",
    "experts_forward",
    "grouped_experts",
    "grouped_mm_available",
    "register_experts",
]

EXPERTS_BACKENDS = ("auto", "grouped_mm", "loop")


def _grouped_mm_fn() -> Callable[..., torch.Tensor] | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


def grouped_mm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs for these operands: the op exists, CUDA needs a Hopper
    (sm90+) device for anything but bf16 on older torch, and every row stride is a multiple of
    16 bytes (the kernels' alignment rule, also on CPU)."""
    if _grouped_mm_fn() is None:
        return False
    size = x.element_size()
    if any((t.shape[-1] * size) % 16 or (t.shape[-2] * size) % 16 for t in weights):
        return False
    if (x.shape[-1] * size) % 16:
        return False
    if x.is_cuda:
        major, _ = torch.cuda.get_device_capability(x.device)
        return major >= 9 or (major >= 8 and hasattr(F, "grouped_mm"))
    return True


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on (the CPU grouped matmul refuses
    expanded gradients such as ``sum()``'s)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def _default_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate: Callable[[torch.Tensor], torch.Tensor] = _default_gate,
    backend: str = "auto",
) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert.

    Args:
        x: ``[M, H]`` rows, expert 0's first, then expert 1's, ... (``counts[e]`` rows each).
        counts: ``[E]`` integer rows per expert (may be zero; ``sum == M``).
        gate_up: ``[E, 2I, H]``, down: ``[E, H, I]`` (transformers' layout).
        gate: ``[M, 2I] -> [M, I]`` (default: SiLU(gate) * up on the two halves).
        backend: ``"grouped_mm"`` (one grouped matmul per projection), ``"loop"`` (reference:
            ``F.linear`` per expert; reads ``counts`` on the host), ``"auto"`` (grouped_mm where
            :func:`grouped_mm_available`, else loop).

    Returns ``[M, H]`` in the compute dtype (autocast's when on, else the weights').
    """
    if backend not in EXPERTS_BACKENDS:
        raise ValueError(f"unknown experts backend {backend!r}; choose from {EXPERTS_BACKENDS}")
    dtype = _compute_dtype(x, gate_up.dtype)
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    if backend == "auto":
        backend = "grouped_mm" if grouped_mm_available(x, gate_up, down) else "loop"
    if backend == "loop":
        splits = counts.tolist()
        outs = []
        for e, part in enumerate(torch.split(x, splits)):
            if part.shape[0]:
                h = gate(F.linear(part, gate_up[e]))  # [m, I]
                outs.append(F.linear(h, down[e]))  # [m, H]
        return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])
    mm = _grouped_mm_fn()
    if mm is None:
        raise RuntimeError("backend='grouped_mm' needs torch >= 2.8 (torch._grouped_mm)")
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] group ends
    h = _ContiguousGrad.apply(mm(x, gate_up.transpose(-2, -1), offs=offs))  # [M, 2I]
    h = gate(h)  # [M, I]
    return _ContiguousGrad.apply(mm(h, down.transpose(-2, -1), offs=offs))  # [M, H]


def expert_counts(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert ``[E]`` int64 of ``expert_ids [S]`` without a host read (``bincount``
    sizes its output from the maximum, which a GPU must report to the host)."""
    ones = torch.ones_like(expert_ids, dtype=torch.int64)
    return torch.zeros(n_experts, dtype=torch.int64, device=expert_ids.device).scatter_add_(
        0, expert_ids, ones
    )


def _module_gate(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    apply = getattr(module, "_apply_gate", None)
    if apply is not None:
        return apply
    act = module.act_fn

    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, dim=-1)
        return act(g) * u

    return gate


def experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """transformers' experts forward on grouped GEMMs (see the module docstring).

    ``hidden_states [N, H]``, ``top_k_index [N, k]`` expert ids, ``top_k_weights [N, k]``; the
    module holds ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. Returns ``[N, H]``.
    """
    if getattr(module, "has_bias", False) or not getattr(module, "has_gate", True):
        raise NotImplementedError(
            f"{type(module).__name__}: lmms grouped experts cover gated experts without bias"
        )
    if getattr(module, "is_transposed", False):
        raise NotImplementedError(f"{type(module).__name__}: transposed expert weights")
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # [N*k]
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = expert_counts(flat, module.gate_up_proj.shape[0])  # [E]
    rows = hidden_states[order // k]  # [N*k, H]
    out = grouped_experts(
        rows,
        counts,
        module.gate_up_proj,
        module.down_proj,
        gate=_module_gate(module),
        backend=backend,
    )  # [N*k, H]
    weights = top_k_weights.reshape(-1)[order].to(out.dtype)  # [N*k]
    back = torch.empty_like(out).index_copy(0, order, out * weights[:, None])
    return back.view(n, k, -1).sum(1).to(hidden_states.dtype)  # [N, H]


def register_experts(name: str = "lmms_grouped_mm", *, backend: str = "auto") -> str:
    """Register :func:`experts_forward` in transformers' experts-implementation registry under
    ``name`` and return it; select it with ``config._experts_implementation = name`` (the text
    config of a multimodal model)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def fn(module, hidden_states, top_k_index, top_k_weights):
        return experts_forward(module, hidden_states, top_k_index, top_k_weights, backend=backend)

    ALL_EXPERTS_FUNCTIONS.register(name, fn)
    return name
