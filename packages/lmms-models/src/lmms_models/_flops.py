"""FLOP counts for MFU, computed from the config alone (works for meta-device models).

Convention (the one of /work/shared/ENVIRONMENT.md's calibration, PaLM appendix B and Megatron):

* matmul FLOPs: ``6 · N · tokens`` for training (forward 2, backward 4), where ``N`` counts the
  parameters that take part in a matmul per token: every non-embedding weight, plus the LM head
  (a real ``[H, V]`` matmul, even when tied), minus the input embedding (a lookup). For MoE only the
  ``top_k`` active experts and the router count. Biases and norm weights are included (tiny).
* attention FLOPs: ``12 · L · (heads · head_dim) · s`` per token of a segment of length ``s``, i.e.
  ``12 · L · d_attn · Σ s_i²`` for a pack: QKᵀ and AV, forward and backward, over the *full* ``s × s``
  score matrix. Causal attention does half of that work; pass ``causal_half=True`` for the stricter
  count. The default keeps numbers comparable with the calibration and with peers' MFU.
* activation recomputation is not counted (MFU, not HFU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "attention_flops",
    "dense_lm_matmul_params",
    "vit_matmul_flops",
    "window_lengths",
]


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def head_dim(cfg: Any) -> int:
    return _get(cfg, "head_dim") or _get(cfg, "hidden_size") // _get(cfg, "num_attention_heads")


def dense_lm_matmul_params(cfg: Any, *, qk_norm: bool = False, attention_bias: bool = True) -> int:
    """Matmul parameters of a Qwen-style decoder per token (see module docstring).

    Per layer: q/k/v/o projections (+ q/k/v biases for Qwen2), a SwiGLU MLP (gate, up, down) or,
    for MoE layers, ``top_k`` experts of ``moe_intermediate_size`` plus the router, 2 RMSNorms
    (+ q/k norms for Qwen3). Plus the final norm and the LM head.
    """
    h = _get(cfg, "hidden_size")
    n_layers = _get(cfg, "num_hidden_layers")
    nh, nkv, d = _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads"), head_dim(cfg)
    vocab = _get(cfg, "vocab_size")
    attn = h * nh * d + 2 * h * nkv * d + nh * d * h
    if attention_bias:
        attn += nh * d + 2 * nkv * d
    if qk_norm:
        attn += 2 * d
    dense_mlp = 3 * h * _get(cfg, "intermediate_size")
    n_experts = _get(cfg, "num_experts") or _get(cfg, "num_local_experts")
    total = 0
    for i in range(n_layers):
        mlp = dense_mlp
        if n_experts and _is_moe_layer(cfg, i):
            mlp = _get(cfg, "num_experts_per_tok") * 3 * h * _get(cfg, "moe_intermediate_size")
            mlp += h * n_experts  # router
        total += attn + mlp + 2 * h
    return total + h + h * vocab


def _is_moe_layer(cfg: Any, i: int) -> bool:
    step = _get(cfg, "decoder_sparse_step", 1) or 1
    return i not in (_get(cfg, "mlp_only_layers") or []) and (i + 1) % step == 0


def attention_flops(
    n_layers: int, attn_width: int, seq_lens: Iterable[int], *, causal_half: bool = False
) -> float:
    """Training FLOPs of softmax attention: ``12 · L · d_attn · Σ s²`` (halved if ``causal_half``)."""
    total = 12.0 * n_layers * attn_width * sum(float(s) * s for s in seq_lens)
    return total / 2 if causal_half else total


def vit_matmul_flops(params: dict[str, int], patches: int, merge: int) -> float:
    """``6·N`` of a merging ViT over ``patches`` patches: ``params["per_patch"]`` (blocks, patch
    embedding) per patch, ``params["per_merged"]`` (merger) per ``merge x merge`` patches."""
    return 6.0 * (params["per_patch"] * patches + params["per_merged"] * patches / merge**2)


def window_lengths(n: int, window: int) -> Sequence[int]:
    """Sizes of consecutive windows of ``window`` covering ``n`` (the last one partial)."""
    full, rest = divmod(n, window)
    return [window] * full + ([rest] if rest else [])
