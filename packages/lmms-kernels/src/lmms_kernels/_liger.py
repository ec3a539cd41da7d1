"""Instance-scoped, reversible Liger-Kernel patching, by the caller's plan of module classes.

``apply_liger(model, plan)`` swaps the ``forward`` of this model's RMSNorm and SwiGLU MLP
*instances* (an instance attribute shadowing the class method) for ones that call Liger's
Triton ops. Nothing global changes: other models of the same class are untouched, and
``handle.remove()`` deletes the instance attributes again, so the modules are the very same
objects with the very same ``__dict__`` and produce bit-identical outputs.

What is patched is the caller's :class:`LigerPlan`: the class names of the RMSNorm modules and
of the gate/up/down SwiGLU MLPs, and the RMSNorm's semantics (Liger's casting mode: ``w * x``, or
with offset 1 a zero-centred ``x * (1 + w)``). This package knows no model: each
model family states its plan (lmms-models: ``ModelSpec.liger_plan``, docs/kernels.md lists them).

Not patched, on purpose: MoE experts (grouped ``Qwen3MoeExperts`` weights, not a SwiGLU module);
Qwen3-VL's vision tower (LayerNorm + GELU MLP, no Liger equivalent used here); RoPE/mRoPE:
upstream applies rotary embeddings through a module-level function (``apply_rotary_pos_emb``)
called inside the attention forward, so an instance-scoped swap would need either replacing
that module global (which would change every model of the family in the process) or a copy of
the attention forward (which the design forbids). RoPE is a small share of step time; see
docs/kernels.md.

A plan lists the classes it expects; if a model contains none of an expected kind (an upstream
rename; an absent MLP is allowed with ``mlp_optional``, e.g. all layers sparse), or an MLP whose
activation is not SiLU, ``apply_liger`` raises instead of silently patching less. Liger's ops need CUDA tensors: a patched module called with tensors on
another device runs its upstream forward (so a CPU quickstart with ``use_liger_kernel`` works).
Patching is independent of packing (``use_rmpad``): RMSNorm and SwiGLU act per token.

SwiGLU MLPs whose intermediate width is not a multiple of 8 (Qwen2.5-VL's vision MLP: 3420)
run with the gate/up weights zero-padded to the next multiple of 8 and the down weight's
columns likewise (``_aligned_swiglu``). The ``[tokens, 3420]`` bf16 activations have a row
pitch of 6840 bytes, not a multiple of 16, so cuBLAS cannot use its Hopper kernels for any of
the MLP's GEMMs (forward or backward) and falls back to SM80 CUTLASS ones: on the H200 these ran
at ~210 TFLOP/s and took ~23% of a packed Qwen2.5-VL-3B step (benchmarks/models/NOTES.md). The
padding is exact: the padded gate/up outputs are exactly 0, ``silu(0)·0 = 0``, and zero
columns of the down weight add exact zeros; ``F.pad``'s backward slices the weight gradients
back, so the padded entries never exist outside the forward. The copies cost a few MB per layer.
``apply_liger(..., align_mlp=False)`` turns it off (the benchmark's before/after).

Under ``torch.compile`` the patched forwards run the upstream torch code instead of Liger's
ops. Liger's autograd.Functions launch Triton kernels that dynamo cannot trace (it raised an
AssertionError on the H200), and wrapping them as custom ops would make them opaque: Inductor
could no longer fuse the norm with the residual add before it or the casts around it. Inductor
generates fused RMSNorm and SiLU-times-up kernels (forward and backward) from the upstream
math itself, so compiled blocks lose nothing by skipping Liger; eager blocks keep using it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["LigerPlan", "PatchHandle", "apply_liger"]


@dataclass(kw_only=True, slots=True, frozen=True)
class LigerPlan:
    """What :func:`apply_liger` patches in a model: module classes by name, as data.

    * ``rms_norm``: class names of the RMSNorm modules; ``mlp``: of the gate/up/down SwiGLU MLPs.
    * ``rms_casting`` (required) / ``rms_offset``: the RMSNorm's semantics, one of Liger's
      ``casting_mode`` strings: the x-only upcast ``w * (x_fp32 * rstd).to(dtype)`` (offset 0),
      the x-and-w upcast ``((x_fp32 * rstd) * (offset + w_fp32)).to(dtype)`` (a zero-centred
      weight: offset 1), or no casting. The family states it: it owns its norms' numerics.
    * ``mlp_optional``: a model may hold no such MLP (sparse decoders whose layers may all be MoE).
    """

    rms_norm: tuple[str, ...]
    mlp: tuple[str, ...]
    rms_casting: str
    rms_offset: float = 0.0
    mlp_optional: bool = False

    @classmethod
    def of(cls, plan: LigerPlan | Mapping[str, Any]) -> LigerPlan:
        """``plan`` itself, or the plan of a mapping of these fields (a model spec's data)."""
        if isinstance(plan, LigerPlan):
            return plan
        if not isinstance(plan, Mapping) or not plan:
            raise TypeError(
                f"apply_liger takes a LigerPlan or a mapping of its fields, got {plan!r} (a model "
                "family states its plan: lmms_models' ModelSpec.liger_plan)"
            )
        # the dataclass names a missing field in its TypeError
        names = {k: tuple(plan[k]) for k in ("rms_norm", "mlp") if k in plan}
        return cls(**{**plan, **names})


_SILU_NAMES = frozenset({"SiLU", "SiLUActivation"})
_MARK = "_lmms_liger_patched"


@dataclass(kw_only=True, slots=True)
class PatchHandle:
    """Undo record of one ``apply_liger`` call. ``remove()`` restores every module exactly."""

    plan: LigerPlan
    patched: dict[str, list[str]] = field(default_factory=dict)  # kind -> module names
    _records: list[tuple[nn.Module, object]] = field(default_factory=list)
    _removed: bool = False

    def remove(self) -> None:
        """Restore the original forwards (idempotent)."""
        if self._removed:
            return
        for module, previous in reversed(self._records):
            del module.forward
            if previous is not None:  # the instance already had its own forward before us
                module.forward = previous
            delattr(module, _MARK)
        self._records.clear()
        self._removed = True


@functools.cache
def _liger_ops():
    """(rms_norm(x, w, eps), silu_mul(a, b)) from liger-kernel; raises if it is not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError("Liger patching needs liger-kernel: pip install 'lmms-kernels[liger]'")
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def rms_norm(x, weight, eps, offset, casting):  # see LigerPlan.rms_casting
        return LigerRMSNormFunction.apply(x.contiguous(), weight, eps, offset, casting, False)

    def silu_mul(a, b):
        return LigerSiLUMulFunction.apply(a, b)

    return rms_norm, silu_mul


def _use_liger(x: torch.Tensor) -> bool:
    return x.is_cuda


def _patch_rms_norm(module: nn.Module, original, offset: float, casting: str):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None or getattr(module, "weight", None) is None:
        raise RuntimeError(
            f"{type(module).__name__} has no weight/variance_epsilon: cannot use Liger RMSNorm"
        )

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not _use_liger(hidden_states):
            return original(hidden_states)  # compiled: Inductor fuses the upstream math
        rms_norm, _ = _liger_ops()
        return rms_norm(hidden_states, module.weight, eps, offset, casting)

    return forward


def _patch_mlp(module: nn.Module, original, align: bool = True):
    missing = [n for n in ("gate_proj", "up_proj", "down_proj") if not hasattr(module, n)]
    if missing:
        raise RuntimeError(f"{type(module).__name__} lacks {missing}: not a SwiGLU MLP")
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in _SILU_NAMES:
        raise RuntimeError(
            f"{type(module).__name__} uses activation {type(act).__name__}, not SiLU: Liger SwiGLU does not apply"
        )

    pad = -module.gate_proj.out_features % _ALIGN if align else 0

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not _use_liger(x):
            if pad and x.is_cuda:
                return _aligned_swiglu(module, x, pad, _torch_silu_mul)
            return original(x)
        _, silu_mul = _liger_ops()
        if pad:
            return _aligned_swiglu(module, x, pad, silu_mul)
        return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))

    return forward


_ALIGN = 8  # bf16 elements per 16 bytes: the row pitch cuBLAS' Hopper GEMMs need


def _torch_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


def _aligned_swiglu(module: nn.Module, x: torch.Tensor, pad: int, silu_mul) -> torch.Tensor:
    """``down(silu(gate(x)) · up(x))`` with the intermediate width zero-padded by ``pad`` so every
    GEMM sees 16-byte-aligned rows; equal to the unpadded MLP (the padded lanes are exact 0)."""
    F = torch.nn.functional
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj

    def rows(linear: nn.Module) -> torch.Tensor:  # weight [I, H] -> [I + pad, H]
        bias = None if linear.bias is None else F.pad(linear.bias, (0, pad))
        return F.linear(x, F.pad(linear.weight, (0, 0, 0, pad)), bias)

    h = silu_mul(rows(gate), rows(up))  # [T, I + pad], last pad lanes exactly 0
    return F.linear(h, F.pad(down.weight, (0, pad)), down.bias)  # down: [H, I] -> [H, I + pad]


def apply_liger(
    model: nn.Module,
    plan: LigerPlan | Mapping[str, Any],
    *,
    rms_norm: bool = True,
    swiglu: bool = True,
    align_mlp: bool = True,
) -> PatchHandle:
    """Patch this model instance's RMSNorm and SwiGLU MLP modules with Liger kernels.

    ``plan``: the module classes to patch (:class:`LigerPlan`, or a mapping of its fields: the
    model family's ``liger_plan``). Returns a handle whose ``remove()`` restores the model
    exactly. Raises if liger-kernel is missing, the model is already patched, or an expected
    module kind is not found. ``align_mlp``: pad MLP intermediate widths that are not a
    multiple of 8 (module docstring).
    """
    plan = LigerPlan.of(plan)
    _liger_ops()  # fail early when liger-kernel is absent
    steps: list[tuple[str, tuple[str, ...], object]] = []
    if rms_norm:
        rms = functools.partial(_patch_rms_norm, offset=plan.rms_offset, casting=plan.rms_casting)
        steps.append(("rms_norm", plan.rms_norm, rms))
    if swiglu:
        steps.append(("swiglu", plan.mlp, functools.partial(_patch_mlp, align=align_mlp)))
    handle = PatchHandle(plan=plan)
    try:
        for kind, class_names, make in steps:
            names = []
            for name, module in model.named_modules():
                if type(module).__name__ not in class_names:
                    continue
                if hasattr(module, _MARK):
                    raise RuntimeError(
                        f"{name or 'model'} is already Liger-patched; remove the first handle first"
                    )
                previous = module.__dict__.get("forward")
                module.forward = make(module, module.forward)
                setattr(module, _MARK, True)
                handle._records.append((module, previous))
                names.append(name)
            if not names and not (kind == "swiglu" and plan.mlp_optional):
                found = sorted({type(m).__name__ for m in model.modules()})
                raise RuntimeError(
                    f"Liger {kind} patch found no {class_names} module in "
                    f"{type(model).__name__} (upstream rename?); module classes present: {found}"
                )
            handle.patched[kind] = names
    except Exception:
        handle.remove()
        raise
    return handle
