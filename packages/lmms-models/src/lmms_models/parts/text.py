"""Text-decoder pieces the families share: the tiny decoder shape of the tests and examples,
the Qwen2 decoder part (q/k/v biases, GQA, SwiGLU, RMSNorm; ``qwen2`` and ``qwen2_5``), and the
empty prepared mask for decoders without a ``{layer type: mask}`` branch (Qwen3-MoE, Llama,
Qwen3-Omni)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._attention import forward_pre_hook
from .._plans import QWEN2_TP_PLAN, QWEN2_TP_SP_PLAN
from .._spec import ModelSpec

__all__ = [
    "PREPARED_MASK_SHAPE",
    "QWEN2_LIGER_PLAN",
    "TINY_TEXT_IDS",
    "Qwen2DecoderPart",
    "prepared_empty_mask",
    "tiny_text",
]

#: Liger (lmms_kernels.apply_liger) on the Qwen2 decoder, in every family that has one.
QWEN2_LIGER_PLAN = {"rms_norm": ("Qwen2RMSNorm",), "mlp": ("Qwen2MLP",), "rms_casting": "llama"}

#: BOS/EOS of the tiny presets' text configs (inside the tiny vocab of 1024).
TINY_TEXT_IDS = {"bos_token_id": 1004, "eos_token_id": 1005}


def tiny_text(**overrides: Any) -> dict[str, Any]:
    """Shared tiny decoder shape: 2 layers, 4 heads / 2 KV heads, vocab 1024."""
    cfg: dict[str, Any] = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg.update(overrides)
    return cfg


#: The "prepared" attention mask the packed forward gives the decoder: upstream returns a 4-D
#: mask as-is and hands it to every attention call, where lmms varlen attention ignores it (the
#: pack's ``cu_seq_lens_q/k`` define the segments). Empty, so nothing is allocated, and any
#: attention that would use it (upstream eager/SDPA) fails on its shape instead of attending
#: across samples.
PREPARED_MASK_SHAPE = (1, 1, 0, 0)


@contextlib.contextmanager
def prepared_empty_mask(text_model: nn.Module) -> Iterator[None]:
    """While active, a call of ``text_model`` with the pack's ``cu_seq_lens_q`` (varlen attention)
    and no ``attention_mask`` gets the empty prepared mask, so transformers skips its mask
    preparation and the packed-sequence search it does there (a host read of ``position_ids``)."""

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or kwargs.get("attention_mask") is not None:
            return args, kwargs
        mask = torch.empty(PREPARED_MASK_SHAPE, dtype=torch.bool, device=cu.device)
        return args, {**kwargs, "attention_mask": mask}

    with forward_pre_hook(text_model, hook):
        yield


class Qwen2DecoderPart(ModelSpec):
    """The Qwen2 dense decoder (``Qwen2ForCausalLM``: its config/model classes, TP plans, Liger
    plan, the prepared mask mapping, the tiny config); the family states its processor."""

    tp_plan = QWEN2_TP_PLAN
    tp_sp_plan = QWEN2_TP_SP_PLAN
    liger_plan = QWEN2_LIGER_PLAN
    config_class = "Qwen2Config"
    model_class = "Qwen2ForCausalLM"
    mask_mapping = True  # upstream decoder: `isinstance(attention_mask, dict)` branch

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return tiny_text(**overrides)
