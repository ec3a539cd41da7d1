"""Instance-scoped, reversible Liger-Kernel patching for the supported model families.

``apply_liger(model, family)`` swaps the ``forward`` of this model's RMSNorm and SwiGLU MLP
*instances* (an instance attribute shadowing the class method) for ones that call Liger's
Triton ops. Nothing global changes: other models of the same class are untouched, and
``handle.remove()`` deletes the instance attributes again, so the modules are the very same
objects with the very same ``__dict__`` and produce bit-identical outputs.

What is patched per family (transformers model types):

====================  ==========================================  ==============================
family                RMSNorm                                     SwiGLU MLP
====================  ==========================================  ==============================
qwen2 (Qwen2, 2.5)    Qwen2RMSNorm                                Qwen2MLP
qwen3                 Qwen3RMSNorm (incl. q_norm/k_norm)          Qwen3MLP
qwen3_moe             Qwen3MoeRMSNorm (incl. q_norm/k_norm)       Qwen3MoeMLP (dense layers only)
qwen2_5_vl            Qwen2_5_VLRMSNorm (text and vision)         Qwen2MLP (text), Qwen2_5_VLMLP (vision)
qwen3_vl              Qwen3VLTextRMSNorm                          Qwen3VLTextMLP
qwen3_vl_moe          Qwen3VLMoeTextRMSNorm                       Qwen3VLMoeTextMLP (dense layers)
llava_onevision       Qwen2RMSNorm                                Qwen2MLP
qwen2_audio, aero     Qwen2RMSNorm                                Qwen2MLP
qwen2_5_omni          Qwen2_5OmniRMSNorm                          Qwen2MLP (text), Qwen2_5OmniMLP (vision)
qwen3_omni_moe        Qwen3OmniMoe(Thinker)TextRMSNorm            Qwen3OmniMoeThinkerTextMLP (dense layers)
qwen3_5 (+ _moe)      Qwen3_5RMSNorm: x * (1 + w), "gemma" mode   Qwen3_5MLP (dense / shared expert)
====================  ==========================================  ==============================

Not patched, on purpose: MoE experts (grouped ``Qwen3MoeExperts`` weights, not a SwiGLU module);
Qwen3-VL's vision tower (LayerNorm + GELU MLP, no Liger equivalent used here); RoPE/mRoPE:
upstream applies rotary embeddings through a module-level function (``apply_rotary_pos_emb``)
called inside the attention forward, so an instance-scoped swap would need either replacing
that module global (which would change every model of the family in the process) or a copy of
the attention forward (which the design forbids). RoPE is a small share of step time; see
docs/kernels.md.

Each family lists the classes it expects; if a model contains none of an expected kind (an
upstream rename), or an MLP whose activation is not SiLU, ``apply_liger`` raises instead of
silently patching less. Liger's ops need CUDA tensors: a patched module called with tensors on
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
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["LIGER_FAMILIES", "PatchHandle", "apply_liger"]


@dataclass(kw_only=True, slots=True, frozen=True)
class _FamilySpec:
    rms_norm: tuple[str, ...]  # class names of RMSNorm modules to patch
    mlp: tuple[str, ...]  # class names of gate/up/down SwiGLU MLPs to patch
    # Liger's RMSNorm semantics: "llama" = w * (x_fp32 * rstd).to(dtype), offset 0;
    # "gemma" = ((x_fp32 * rstd) * (offset + w_fp32)).to(dtype) (Qwen3.5's zero-centred weight)
    rms_offset: float = 0.0
    rms_casting: str = "llama"


LIGER_FAMILIES: dict[str, _FamilySpec] = {
    "qwen2": _FamilySpec(rms_norm=("Qwen2RMSNorm",), mlp=("Qwen2MLP",)),
    "qwen2_5": _FamilySpec(rms_norm=("Qwen2RMSNorm",), mlp=("Qwen2MLP",)),  # Qwen2 modules
    "qwen3": _FamilySpec(rms_norm=("Qwen3RMSNorm",), mlp=("Qwen3MLP",)),
    "qwen3_moe": _FamilySpec(rms_norm=("Qwen3MoeRMSNorm",), mlp=("Qwen3MoeMLP",)),
    "qwen2_5_vl": _FamilySpec(rms_norm=("Qwen2_5_VLRMSNorm",), mlp=("Qwen2MLP", "Qwen2_5_VLMLP")),
    "qwen3_vl": _FamilySpec(rms_norm=("Qwen3VLTextRMSNorm",), mlp=("Qwen3VLTextMLP",)),
    # LLaVA-OneVision: the Qwen2 decoder (SigLIP's LayerNorm and GELU MLP stay upstream)
    "llava_onevision": _FamilySpec(rms_norm=("Qwen2RMSNorm",), mlp=("Qwen2MLP",)),
    "llama": _FamilySpec(rms_norm=("LlamaRMSNorm",), mlp=("LlamaMLP",)),
    # Qwen2-Audio and Aero: the Qwen2 decoder (the Whisper-style audio encoder: LayerNorm + GELU)
    "qwen2_audio": _FamilySpec(rms_norm=("Qwen2RMSNorm",), mlp=("Qwen2MLP",)),
    "aero": _FamilySpec(rms_norm=("Qwen2RMSNorm",), mlp=("Qwen2MLP",)),
    # Qwen2.5-Omni thinker: text decoder (Qwen2MLP) and the Qwen2.5-VL-style vision tower's SwiGLU
    "qwen2_5_omni": _FamilySpec(
        rms_norm=("Qwen2_5OmniRMSNorm",), mlp=("Qwen2MLP", "Qwen2_5OmniMLP")
    ),
    # sparse decoders: norms everywhere, dense MLPs only where a layer is dense (often none)
    "qwen3_vl_moe": _FamilySpec(rms_norm=("Qwen3VLMoeTextRMSNorm",), mlp=("Qwen3VLMoeTextMLP",)),
    # Qwen3-Omni-MoE thinker: decoder norms (incl. q/k) and the final norm; the audio tower's
    # LayerNorm/GELU and the vision tower's GELU MLP stay upstream
    "qwen3_omni_moe": _FamilySpec(
        rms_norm=("Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm"),
        mlp=("Qwen3OmniMoeThinkerTextMLP",),
    ),
    # Qwen3.5: zero-centred RMSNorm weight, x * (1 + w) in fp32 (the gated norm inside the
    # Gated DeltaNet mixer stays upstream); the vision tower's MLP is GELU (not patched)
    "qwen3_5": _FamilySpec(
        rms_norm=("Qwen3_5RMSNorm",), mlp=("Qwen3_5MLP",), rms_offset=1.0, rms_casting="gemma"
    ),
    "qwen3_5_moe": _FamilySpec(
        rms_norm=("Qwen3_5MoeRMSNorm",),
        mlp=("Qwen3_5MoeMLP",),
        rms_offset=1.0,
        rms_casting="gemma",
    ),
}
# families whose MLP may legitimately be absent (all layers sparse)
_MLP_OPTIONAL = frozenset({"qwen3_moe", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5_moe"})
_SILU_NAMES = frozenset({"SiLU", "SiLUActivation"})
_MARK = "_lmms_liger_patched"


@dataclass(kw_only=True, slots=True)
class PatchHandle:
    """Undo record of one ``apply_liger`` call. ``remove()`` restores every module exactly."""

    family: str
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

    def rms_norm(x, weight, eps, offset=0.0, casting="llama"):  # see _FamilySpec.rms_casting
        return LigerRMSNormFunction.apply(x.contiguous(), weight, eps, offset, casting, False)

    def silu_mul(a, b):
        return LigerSiLUMulFunction.apply(a, b)

    return rms_norm, silu_mul


def _use_liger(x: torch.Tensor) -> bool:
    return x.is_cuda


def _patch_rms_norm(module: nn.Module, original, offset: float = 0.0, casting: str = "llama"):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None or getattr(module, "weight", None) is None:
        raise RuntimeError(
            f"{type(module).__name__} has no weight/variance_epsilon: cannot use Liger RMSNorm"
        )

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not _use_liger(hidden_states):
            return original(hidden_states)  # compiled: Inductor fuses the upstream math
        rms_norm, _ = _liger_ops()
        if offset == 0.0 and casting == "llama":
            return rms_norm(hidden_states, module.weight, eps)
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
    family: str,
    *,
    rms_norm: bool = True,
    swiglu: bool = True,
    align_mlp: bool = True,
) -> PatchHandle:
    """Patch this model instance's RMSNorm and SwiGLU MLP modules with Liger kernels.

    ``family`` is the transformers model type (see ``LIGER_FAMILIES``). Returns a handle whose
    ``remove()`` restores the model exactly. Raises if liger-kernel is missing, the family is
    unknown, the model is already patched, or an expected module kind is not found.
    ``align_mlp``: pad MLP intermediate widths that are not a multiple of 8 (module docstring).
    """
    if family not in LIGER_FAMILIES:
        raise ValueError(
            f"no Liger patch plan for family {family!r}; known: {sorted(LIGER_FAMILIES)}"
        )
    _liger_ops()  # fail early when liger-kernel is absent
    spec = LIGER_FAMILIES[family]
    plan: list[tuple[str, tuple[str, ...], object]] = []
    if rms_norm:
        rms = functools.partial(_patch_rms_norm, offset=spec.rms_offset, casting=spec.rms_casting)
        plan.append(("rms_norm", spec.rms_norm, rms))
    if swiglu:
        plan.append(("swiglu", spec.mlp, functools.partial(_patch_mlp, align=align_mlp)))
    handle = PatchHandle(family=family)
    try:
        for kind, class_names, make in plan:
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
            if not names and not (kind == "swiglu" and family in _MLP_OPTIONAL):
                found = sorted({type(m).__name__ for m in model.modules()})
                raise RuntimeError(
                    f"Liger {kind} patch for {family!r} found no {class_names} module in "
                    f"{type(model).__name__} (upstream rename?); module classes present: {found}"
                )
            handle.patched[kind] = names
    except Exception:
        handle.remove()
        raise
    return handle
