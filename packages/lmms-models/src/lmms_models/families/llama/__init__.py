"""LLaMA dense decoder (``LlamaForCausalLM``): no biases by default, GQA, SwiGLU, RMSNorm, RoPE.

Besides the family's own layout (``model_type: llama``), a local folder in LLaDA's release layout
(``model_type: llada``: OLMo-style names ``model.transformer.blocks.N.ff_proj``, its own config
keys, a bidirectional LLaMA decoder) builds through the same upstream class: the config and the
parameter names are translated by :mod:`lmms_models.layouts.llada`; LLaDA's remote code
is never imported.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ... import _flops
from ..._plans import QWEN2_TP_PLAN
from ..._registry import register_model
from ..._spec import ModelSpec
from ...parts.text import prepared_empty_mask, tiny_text

__all__ = ["LlamaSpec"]

#: LLaMA-3-8B's shape (the decoder of LLaDA-8B differs: 126464 vocab, MHA, 12288 MLP).
LLAMA3_8B: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    use_cache=False,
)
#: LLaDA-8B's decoder in LLaMA terms (what a ``model_type: llada`` folder of that size reads as).
LLADA_8B: dict[str, Any] = dict(
    LLAMA3_8B,
    vocab_size=126464,
    intermediate_size=12288,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    is_causal=False,
    mask_token_id=126336,
)


@register_model("llama")
class LlamaSpec(ModelSpec):
    tp_plan = QWEN2_TP_PLAN  # same module names (q/k/v/o, gate/up/down) as Qwen2
    processor_family = "qwen2"  # text chats; real runs pass the checkpoint's own tokenizer
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("LlamaRMSNorm",),
        "mlp": ("LlamaMLP",),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
    }
    config_class = "LlamaConfig"
    model_class = "LlamaForCausalLM"
    #: LlamaModel has no ``{layer type: mask}`` branch, so no ``mask_mapping``: the packed forward
    #: hands it qwen3_moe's empty prepared mask (no host read of ``position_ids``).
    presets = {"llama3_8b": LLAMA3_8B, "llada_8b": LLADA_8B}  # noqa: RUF012

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return tiny_text(**{"attention_bias": False, "rope_theta": 500000.0, **overrides})

    def media_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The packed forward's context: the empty prepared mask on the text decoder."""
        return prepared_empty_mask(self.text_model(model))

    def lm_matmul_params(self, config: Any) -> int:
        cfg = self.text_config(config)
        bias = bool(_flops._get(cfg, "attention_bias", False))
        return _flops.dense_lm_matmul_params(cfg, attention_bias=bias)

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """:meth:`ModelSpec.build_module`; a folder in LLaDA's layout is translated.

        LLaDA folder: the config becomes a LLaMA config (``is_causal: false``, the mask token id)
        and the weights load under the upstream names (strict: every key must map and match).
        On ``meta`` only the config is read; the trainer loads the weights with
        :func:`~lmms_models.layouts.llada.pretrained_key_map`.
        """
        from ...layouts.llada import is_llada_folder, llada_config, read_llada_weights

        if not isinstance(source, str) or not is_llada_folder(source):
            return super().build_module(source, device, dtype)
        conf = llada_config(source)
        if device.type == "meta":
            return super().build_module(conf, device, dtype)
        import transformers

        weights = read_llada_weights(source)  # upstream names
        hf_config = self.make_config(conf)
        hf_config._attn_implementation = "sdpa"
        with torch.device("meta"):  # the expected keys, nothing allocated
            expected = set(getattr(transformers, self.model_class)(hf_config).state_dict())
        if hf_config.tie_word_embeddings:  # one table: the head reads the embedding's
            expected.discard("lm_head.weight")
        if set(weights) != expected:
            missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
            raise ValueError(
                f"{source}: the LLaDA weights do not fit its config "
                f"(missing {missing[:4]}, unexpected {extra[:4]})"
            )
        # from_pretrained with the renamed tensors: no random init of an 8B model first
        model = getattr(transformers, self.model_class).from_pretrained(
            None, config=hf_config, state_dict=weights, dtype=dtype
        )
        return model.to(device)
