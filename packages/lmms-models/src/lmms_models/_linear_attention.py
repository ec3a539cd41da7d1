"""Packed forwards for linear-attention token mixers (Gated DeltaNet), installed per instance.

Why a forward and not a registry hook: upstream's mixers are not packing-exact. transformers'
Qwen3.5 mixer hands the pack's ``cu_seq_lens_q`` to the delta-rule kernel (flash-linear-attention
when installed; its torch fallback ignores them in 5.17 and refuses them in 5.24) but *never* to
its short causal convolution, whose window then reads the last ``K-1`` tokens of the previous
sample. flash-linear-attention's own layers are exact with ``cu_seqlens`` but run Triton only
(no CPU). And neither can split heads for Ulysses SP. So lmms gives each mixer instance a forward
that reuses its parameters and calls ``lmms_kernels``' varlen ops (flash-linear-attention's
kernels on CUDA, the plain-torch reference elsewhere). :func:`install_packed_mixers` returns a
handle whose ``remove()`` restores the upstream forward (bit-identical: nothing else changes).

The code is single-device: the per-head core (convolution, decay, write strength, delta rule)
is a child module of each mixer (:class:`DeltaRuleCore`, named :data:`CORE`). Under Ulysses SP
the family's plan (``LinearAttentionMixin.linear_sp_plan``) puts lmms_parallel's
``sp_linear_heads`` style on it: the projections run on this rank's tokens; q, k, v, the decay
and write-strength inputs go through one all-to-all each (tokens gathered, heads split), the
convolution (per channel, so per head) and the recurrence run on whole samples with the
*global* ``cu_seqlens`` for ``H/sp`` heads, and the output comes back through one all-to-all.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CORE", "DeltaRuleCore", "LinearMixerHandle", "MixerSettings", "install_packed_mixers"]


@dataclass(kw_only=True, slots=True)
class MixerSettings:
    """What an installed packed mixer reads at call time: the ``lmms_kernels`` linear-attention
    backend (``"auto"``, ``"torch"``, ``"fla"``)."""

    backend: str = "auto"


@dataclass(slots=True)
class LinearMixerHandle:
    """Undo of :func:`install_packed_mixers` (``remove()`` restores the upstream forwards)."""

    mixers: list[nn.Module] = field(default_factory=list)

    def remove(self) -> None:
        for m in self.mixers:
            vars(m).pop("forward", None)
            vars(m).pop("_lmms_mixer", None)
            m._modules.pop(CORE, None)
        self.mixers = []


def install_packed_mixers(
    mixers: list[nn.Module], forward: Callable[..., Any], settings: MixerSettings
) -> LinearMixerHandle:
    """Give every module of ``mixers`` the packed ``forward`` (a function taking the module
    first) with ``settings`` and its :class:`DeltaRuleCore`; installing again only updates the
    settings (the core, and any plan style on it, stays)."""
    for m in mixers:
        if not isinstance(getattr(m, CORE, None), DeltaRuleCore):
            m.add_module(CORE, DeltaRuleCore())
        m._lmms_mixer = settings  # type: ignore[assignment]
        m.forward = types.MethodType(forward, m)  # type: ignore[method-assign]
    return LinearMixerHandle(list(mixers))


# ----------------------------------------------------------------------------- shared pieces


def _row_segments(
    hidden: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [B, L, H]`` as ``[B*L, H]`` and its ``cu_seqlens``: the pack's (``cu_seq_lens_q``
    from lmms' packed forward, or flash-linear-attention's ``cu_seqlens``), else one segment per
    batch row."""
    b, length, width = hidden.shape
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu = kwargs.get("cu_seqlens")
    if cu is None:
        cu = torch.arange(0, (b + 1) * length, length, dtype=torch.int32, device=hidden.device)
    elif b != 1:
        raise ValueError(f"a packed row has batch size 1, got {b} rows with cu_seqlens")
    return hidden.reshape(b * length, width), cu


#: name of the per-head core under each installed mixer (the module boundary lmms_parallel's
#: ``sp_linear_heads`` style hooks for Ulysses SP: :attr:`LinearAttentionMixin.linear_sp_plan`)
CORE = "delta_rule_core"


class DeltaRuleCore(nn.Module):
    """The per-head core of a Gated DeltaNet mixer, between its projections and its output norm:
    the short convolution (``conv_w`` None: plain SiLU), the decay, the write strength and the
    delta rule on whole samples (``cu_seqlens``). Holds no parameters (the mixer's are passed
    in, per head); called with keywords only, so a plan style can rewrite them (under Ulysses SP
    lmms_parallel's ``sp_linear_heads`` gathers the tokens and keeps this rank's heads)."""

    def forward(
        self,
        *,
        q: torch.Tensor,  # [T, Hk, Dk]
        k: torch.Tensor,
        v: torch.Tensor,  # [T, Hv, Dv]
        a: torch.Tensor,  # [T, Hv] decay input
        b: torch.Tensor,  # [T, Hv] write-strength input
        conv_w: tuple[torch.Tensor, ...] | None,  # [C_q, K], [C_k, K], [C_v, K]
        conv_b: tuple[torch.Tensor | None, ...] | None,
        a_log: torch.Tensor,  # [Hv]
        dt_bias: torch.Tensor,  # [Hv]
        cu_seqlens: torch.Tensor,
        backend: str,
        beta_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, Hv, Dv]
        from lmms_kernels import causal_conv1d_varlen, gated_delta_rule_varlen

        total = q.shape[0]
        if conv_w is None:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        else:
            outs = []
            for x, w, bias in zip((q, k, v), conv_w, conv_b or (None,) * 3, strict=True):
                y = causal_conv1d_varlen(x.reshape(total, -1), w, bias, cu_seqlens, backend=backend)
                outs.append(y.reshape(x.shape))
            q, k, v = outs
        beta = b.sigmoid() * beta_scale
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # [T, Hv] log decay
        return gated_delta_rule_varlen(
            q, k, v, g, beta, cu_seqlens, qk_l2norm=True, backend=backend
        )


def _delta_rule(
    mixer: nn.Module,
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hv, Dv]
    a: torch.Tensor,  # [T, Hv]
    b: torch.Tensor,  # [T, Hv]
    conv_w: tuple[torch.Tensor, ...] | None,
    conv_b: tuple[torch.Tensor | None, ...] | None,
    cu: torch.Tensor,
    *,
    beta_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hv, Dv]
    """``mixer``'s core (:class:`DeltaRuleCore`) on its per-head inputs and parameters."""
    core = getattr(mixer, CORE)
    return core(
        q=q, k=k, v=v, a=a, b=b, conv_w=conv_w, conv_b=conv_b, a_log=mixer.A_log,
        dt_bias=mixer.dt_bias, cu_seqlens=cu, backend=mixer._lmms_mixer.backend,
        beta_scale=beta_scale,
    )  # fmt: skip


# ----------------------------------------------------------------------------- Qwen3.5 layout


def qwen3_5_packed_mixer(
    self: nn.Module,
    hidden_states: torch.Tensor,  # [1, T(/sp), H]
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    cache_params: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Packed forward of transformers' ``Qwen3_5GatedDeltaNet`` (and the MoE variant's): fused
    ``in_proj_qkv`` through one depthwise ``conv1d`` over ``[q | k | v]`` channels, ``in_proj_z``
    gate into the gated RMSNorm, ``in_proj_a`` / ``in_proj_b`` into the decay and write strength."""
    if cache is not None or cache_params is not None:
        raise NotImplementedError("the packed Gated DeltaNet mixer is for training (no cache)")
    b, length, _ = hidden_states.shape
    x, cu = _row_segments(hidden_states, kwargs)
    if attention_mask is not None and attention_mask.ndim == 2:
        x = x * attention_mask.reshape(-1, 1).to(x.dtype)  # upstream zeroes padded inputs too
    hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
    q, k, v = self.in_proj_qkv(x).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    w = self.conv1d.weight.squeeze(1)  # [C, K]
    conv_w = tuple(w.split([self.key_dim, self.key_dim, self.value_dim], dim=0))
    conv_b = (None,) * 3 if self.conv1d.bias is None else tuple(
        self.conv1d.bias.split([self.key_dim, self.key_dim, self.value_dim])
    )  # fmt: skip
    o = _delta_rule(
        self, q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv),
        self.in_proj_a(x), self.in_proj_b(x), conv_w, conv_b, cu,
    )  # fmt: skip
    z = self.in_proj_z(x).reshape(-1, dv)
    o = self.norm(o.reshape(-1, dv), z).reshape(b, length, -1)
    return self.out_proj(o)


# ----------------------------------------------------------------------------- fla layout


def fla_gdn_packed_mixer(
    self: nn.Module,
    hidden_states: torch.Tensor,  # [1, T(/sp), H]
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool | None = False,
    output_attentions: bool | None = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None, Any]:
    """Packed forward of flash-linear-attention's ``GatedDeltaNet`` layer: separate q/k/v
    projections, one ``ShortConvolution`` each, ``a_proj``/``b_proj`` into the decay and write
    strength, ``g_proj`` gate into ``o_norm`` (``FusedRMSNormGated``; on CUDA with the fla
    backend the module itself, else, and under ``torch.compile``, :func:`lmms_kernels.gated_rms_norm`
    on its weight)."""
    from lmms_kernels import gated_rms_norm, resolve_linear_backend

    if use_cache or past_key_values is not None:
        raise NotImplementedError("the packed Gated DeltaNet mixer is for training (no cache)")
    if attention_mask is not None:
        raise NotImplementedError("packed rows carry cu_seqlens, not a padding attention mask")
    b, length, _ = hidden_states.shape
    x, cu = _row_segments(hidden_states, kwargs)
    hk, hv, dk, dv = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
    conv_w = conv_b = None
    if self.use_short_conv:
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        for c in convs:
            if c.activation not in ("silu", "swish"):
                raise NotImplementedError(f"ShortConvolution activation {c.activation!r}")
        conv_w = tuple(c.weight.squeeze(1) for c in convs)
        conv_b = tuple(c.bias for c in convs)
    o = _delta_rule(
        self, self.q_proj(x).reshape(-1, hk, dk), self.k_proj(x).reshape(-1, hk, dk),
        self.v_proj(x).reshape(-1, hv, dv), self.a_proj(x), self.b_proj(x), conv_w, conv_b, cu,
        beta_scale=2.0 if self.allow_neg_eigval else 1.0,
    )  # fmt: skip
    # fla's Triton gated norm in eager mode; under torch.compile the same math in torch (fused by
    # Inductor; fla's Triton wrappers are not traced)
    fused = (
        not torch.compiler.is_compiling()
        and resolve_linear_backend(self._lmms_mixer.backend, o.device) == "fla"
    )
    if self.use_gate:
        gate = self.g_proj(x).reshape(-1, hv, dv)
        if fused:
            o = self.o_norm(o, gate)
        else:
            act = getattr(self.o_norm, "activation", "swish")
            o = gated_rms_norm(o, gate, self.o_norm.weight, self.o_norm.eps, activation=act)
    elif fused:
        o = self.o_norm(o)
    else:
        o = F.rms_norm(o.float(), (dv,), self.o_norm.weight.float(), self.o_norm.eps).to(o.dtype)
    o = self.o_proj(o.reshape(b, length, -1))
    return o, None, past_key_values


# ----------------------------------------------------------------------------- upstream on CPU

#: transformers' kernel entry points of the Qwen3.5 mixers: with flash-linear-attention (or
#: causal-conv1d) installed they resolve to Triton/CUDA kernels, also for CPU tensors.
_UPSTREAM_KERNELS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def upstream_mixer_on_torch(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Upstream's own mixer forward; on a non-CUDA device with transformers' torch fallbacks in
    place of the kernels it found installed (which cannot run there). Module globals of the
    mixer's transformers module are swapped for the call only and restored after it."""
    cls_forward = type(self).forward
    if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        return cls_forward(self, *args, **kwargs)
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.is_cuda:
        return cls_forward(self, *args, **kwargs)
    import sys

    module = sys.modules[type(self).__module__]
    saved = {n: getattr(module, n) for n in _UPSTREAM_KERNELS if hasattr(module, n)}
    try:
        for name, fn in saved.items():
            setattr(module, name, getattr(fn, "__wrapped__", fn))
        return cls_forward(self, *args, **kwargs)
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
