"""What the linear-attention families share: packed mixers switched with the attention, and FLOPs
of the chunked gated delta rule for the MFU.

FLOPs of a Gated DeltaNet layer, per token, beyond its projections (which ``6·N`` counts with
every other matmul weight, the depthwise convolution's taps included: one multiply-add per tap
and channel per token, exactly like a matmul weight). The chunked (WY) form on chunks of ``C``
tokens, per value head with key width ``Dk`` and value width ``Dv``, forward, per chunk:

* ``β·K·Kᵀ`` (``2C²Dk``), the unit-triangular inverse (``2C³/3``), ``u = T·βV`` (``2C²Dv``) and
  ``w = T·βK·e^γ`` (``2C²Dk``);
* the intra-chunk scores ``Q·Kᵀ`` (``2C²Dk``) and their product with the new values (``2C²Dv``);
* reading the state twice (``w·S`` and ``Q·S``: ``4C·Dk·Dv``) and writing it (``Kᵀ·V``:
  ``2C·Dk·Dv``).

That is ``C·(6Dk + 4Dv) + 6·Dk·Dv + 2C²/3`` per token and head; training counts it 3 times
(backward = 2x forward, the convention of the matmul term). Each real token counts once: the
zero padding of a segment's last chunk is not useful work and is not counted (MFU, not HFU), so a
pack of many short samples does a little more work than counted. At Qwen3.5's shape (``C = 64``,
``Dk = Dv = 128``, 32 value heads) this is ~17.6 MFLOP per token and layer, against 805 MFLOP for
softmax attention over a 16k-token sample of the same model: the linear layers cost almost only
their projections.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import _flops
from ._attention import UPSTREAM_BACKENDS
from ._linear_attention import CORE, LinearMixerHandle, MixerSettings, install_packed_mixers

__all__ = ["CHUNK_SIZE", "LinearAttentionMixin", "delta_rule_flops_per_token"]

#: Chunk length of the chunked delta rule (flash-linear-attention's and transformers' default).
CHUNK_SIZE = 64


def delta_rule_flops_per_token(
    value_heads: int, key_dim: int, value_dim: int, *, chunk: int = CHUNK_SIZE
) -> float:
    """Training FLOPs per token of one gated-delta-rule layer (module docstring)."""
    forward = chunk * (6 * key_dim + 4 * value_dim) + 6 * key_dim * value_dim + 2 * chunk**2 / 3
    return 3.0 * value_heads * forward


class _Handles(tuple):
    """Handles removed together, last first."""

    def remove(self) -> None:
        for h in reversed(self):
            h.remove()


class LinearAttentionMixin:
    """Mixed into a :class:`lmms_models.ModelSpec` whose decoder has linear-attention mixers.

    ``packed_mixer``: the packed forward given to every mixer (see
    :mod:`lmms_models._linear_attention`). :meth:`set_attention` switches the mixers with the
    attention: an lmms varlen backend installs the packed mixers, ``"eager"``/``"sdpa"`` restores
    upstream's (reference runs). Ulysses SP: :meth:`install_sp` with :attr:`linear_sp_plan`.
    """

    packed_mixer: Callable[..., Any]
    #: forward of the mixers under ``"eager"``/``"sdpa"`` (None: upstream's class forward)
    upstream_mixer: Callable[..., Any] | None = None
    #: linear-attention backend of newly installed mixers (``lmms_kernels.LINEAR_BACKENDS``)
    linear_backend: str = "auto"
    #: no sequence-parallel TP plan: the SP plans gather the inputs of softmax attention and the
    #: MLP only, a linear-attention mixer would see this rank's rows alone
    tp_sp_plan: dict[str, str] = {}  # noqa: RUF012
    #: Ulysses SP of the linear mixers (lmms_parallel styles, :meth:`install_sp`): all-to-alls
    #: around each mixer's per-head core (tokens gathered and heads split before it, back after)
    linear_sp_plan: dict[str, str] = {f"*.{CORE}": "sp_linear_heads"}  # noqa: RUF012

    def objective_capabilities(self) -> frozenset[str]:
        """A token LM whose linear mixers are causal by construction: no masked diffusion."""
        return frozenset({"token_lm"})

    def linear_mixers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder's linear-attention mixer modules, in layer order."""
        raise NotImplementedError

    def set_attention(
        self,
        model: nn.Module,
        *,
        backend: str = "auto",
        wrapper: Callable[..., torch.Tensor] | None = None,
        vision_backend: str | None = None,
    ) -> dict[str, str]:
        names = super().set_attention(  # type: ignore[misc]
            model, backend=backend, wrapper=wrapper, vision_backend=vision_backend
        )
        mixers = self.linear_mixers(model)
        if backend in UPSTREAM_BACKENDS:
            LinearMixerHandle(mixers).remove()
            if self.upstream_mixer is not None:
                for m in mixers:
                    m.forward = types.MethodType(self.upstream_mixer, m)  # type: ignore[method-assign]
            names["linear"] = "upstream"
            return names
        prev = getattr(mixers[0], "_lmms_mixer", None) if mixers else None
        settings = MixerSettings(backend=prev.backend if prev is not None else self.linear_backend)
        install_packed_mixers(mixers, self.packed_mixer, settings)
        names["linear"] = f"lmms_{settings.backend}"
        return names

    def set_linear_backend(self, model: nn.Module, backend: str) -> LinearMixerHandle:
        """Install the packed mixers with ``backend`` (``"auto"``, ``"torch"``, ``"fla"``),
        keeping their cores (and an SP plan installed on them); returns the handle that removes
        them."""
        settings = MixerSettings(backend=backend)
        return install_packed_mixers(self.linear_mixers(model), self.packed_mixer, settings)

    def install_sp(self, model: nn.Module, sp_group: Any) -> Any:
        """Ulysses SP: the text decoder's tokens sliced as for every LM (``SequenceParallel``,
        softmax attention through the Ulysses wrapper) and :attr:`linear_sp_plan` on the packed
        mixers' cores (installed first: :meth:`set_attention` with an lmms backend)."""
        from lmms_parallel import apply_sp

        if not all(hasattr(m, CORE) for m in self.linear_mixers(model)):
            raise RuntimeError(
                "Ulysses SP runs the packed linear mixers: an lmms attention backend"
            )
        tokens = super().install_sp(model, sp_group)  # type: ignore[misc]
        heads = apply_sp(model, self.linear_sp_plan, sp_group)
        return _Handles((tokens, heads))

    # ---------------------------------------------------------------- FLOPs
    def linear_layer_shape(self, config: Any) -> tuple[int, int, int, int]:
        """``(n_linear_layers, value_heads, key_dim, value_dim)`` of the decoder."""
        raise NotImplementedError

    def full_attention_layers(self, config: Any) -> int:
        """Number of softmax-attention layers of the decoder."""
        raise NotImplementedError

    def lm_flops(self, config: Any, seq_lens: Sequence[int], *, causal_half: bool = False) -> float:
        """``6·N·Σs`` + softmax attention in the full-attention layers + the chunked delta rule
        in the linear ones (module docstring)."""
        cfg = self.text_config(config)  # type: ignore[attr-defined]
        dense = 6.0 * self.lm_matmul_params(config) * sum(seq_lens)  # type: ignore[attr-defined]
        n_full = self.full_attention_layers(cfg)
        attn = 0.0
        if n_full:
            width = _flops._get(cfg, "num_attention_heads") * _flops.head_dim(cfg)
            attn = _flops.attention_flops(n_full, width, seq_lens, causal_half=causal_half)
        n_lin, heads, dk, dv = self.linear_layer_shape(cfg)
        lin = n_lin * delta_rule_flops_per_token(heads, dk, dv) * sum(seq_lens)
        return dense + attn + lin
