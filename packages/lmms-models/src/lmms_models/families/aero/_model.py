"""Aero-1-Audio, written once: Qwen2-Audio's Whisper-style encoder, a linear projector and a
Qwen2.5 causal LM, with the parameter names of the public checkpoint (lmms-lab/Aero-1-Audio):

    audio_tower.*                      transformers' Qwen2AudioEncoder
    audio_modal_projector.linear.*     d_model -> text hidden size
    language_model.model.*             transformers' Qwen2Model
    language_model.lm_head.weight

No transformers class exists for it, so the config and the unpacked model live here. The unpacked
``forward`` is the reference the packed path is tested against: each clip padded to the encoder's
30 s window with its padding masked in attention, the projected features of the valid positions
placed at the ``audio_token_index`` placeholders in order, the Qwen2 LM's own loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen2AudioEncoder,
    Qwen2AudioEncoderConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..._audio import whisper_lengths

__all__ = ["AeroConfig", "AeroForConditionalGeneration"]


class AeroConfig(PretrainedConfig):
    """``audio_config`` (Qwen2-Audio encoder), ``text_config`` (Qwen2), ``audio_token_index``."""

    model_type = "aero"
    sub_configs = {"audio_config": Qwen2AudioEncoderConfig, "text_config": Qwen2Config}  # noqa: RUF012

    def __init__(
        self,
        audio_config: dict[str, Any] | Qwen2AudioEncoderConfig | None = None,
        text_config: dict[str, Any] | Qwen2Config | None = None,
        audio_token_index: int = 151646,
        **kwargs: Any,
    ) -> None:
        if not isinstance(audio_config, PretrainedConfig):
            audio = {k: v for k, v in (audio_config or {}).items() if k != "model_type"}
            audio_config = Qwen2AudioEncoderConfig(**audio)
        if not isinstance(text_config, PretrainedConfig):
            text = {k: v for k, v in (text_config or {}).items() if k != "model_type"}
            text_config = Qwen2Config(**text)
        self.audio_config, self.text_config = audio_config, text_config
        self.audio_token_index = audio_token_index
        kwargs.setdefault("tie_word_embeddings", text_config.tie_word_embeddings)
        super().__init__(**kwargs)

    @property
    def audio_token_id(self) -> int:
        return self.audio_token_index


class AeroProjector(nn.Module):
    """One linear map from the encoder width to the text width (``audio_modal_projector``)."""

    def __init__(self, config: AeroConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.audio_config.d_model, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, H]
        return self.linear(x)


class AeroForConditionalGeneration(PreTrainedModel):
    config_class = AeroConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["Qwen2AudioEncoderLayer", "Qwen2DecoderLayer"]  # noqa: RUF012

    def __init__(self, config: AeroConfig) -> None:
        super().__init__(config)
        self.audio_tower = Qwen2AudioEncoder(config.audio_config)
        self.audio_modal_projector = AeroProjector(config)
        self.language_model = Qwen2ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def audio_features(
        self,
        audio_values: torch.Tensor,  # [n, n_mels, 3000]: clips padded to the window
        audio_attention_mask: torch.Tensor,  # [n, 3000]: 1 on valid frames
    ) -> torch.Tensor:  # [sum tokens, H], in clip order
        """The encoder on padded windows (padding masked in attention), then the projector; only
        each clip's valid tokens are kept."""
        positions, tokens = whisper_lengths(audio_attention_mask.sum(-1))
        n, width = audio_values.shape[0], audio_values.shape[-1]
        keep = (
            torch.arange((width - 2) // 2 + 1, device=positions.device)[None] < positions[:, None]
        )
        mask = torch.zeros(n, 1, keep.shape[1], keep.shape[1], dtype=audio_values.dtype,
                           device=audio_values.device)  # fmt: skip
        mask.masked_fill_(~keep[:, None, None, :], torch.finfo(audio_values.dtype).min)
        hidden = self.audio_tower(audio_values, attention_mask=mask).last_hidden_state  # [n, S, D]
        out = self.audio_modal_projector(hidden)  # [n, S, H]
        valid = torch.arange(out.shape[1], device=out.device)[None] < tokens[:, None]
        return out[valid]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,  # [B, L]
        audio_values: torch.Tensor | None = None,
        audio_attention_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)  # [B, L, H]
        if audio_values is not None:
            feats = self.audio_features(audio_values, audio_attention_mask)
            where = (input_ids == self.config.audio_token_index).unsqueeze(-1)
            if int(where.sum()) != feats.shape[0]:
                raise ValueError(
                    f"audio tokens ({int(where.sum())}) and audio features ({feats.shape[0]}) "
                    "do not match"
                )
            inputs_embeds = inputs_embeds.masked_scatter(where, feats.to(inputs_embeds.dtype))
        return self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            **kwargs,
        )
