"""The audio-LM part: an audio encoder + projector in front of a text decoder, the audio tower in the
vision tower's place for lmms-parallel and the trainer (``qwen2_audio``, ``aero``). The packed
forward runs the encoder on varlen clips (no 30 s padding, see :mod:`lmms_models._audio`) and
places the projected features at the host-known audio placeholder positions."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .. import _flops
from .._audio import dummy_audio_inputs, merge_audio, varlen_audio_forward, whisper_encoder_flops
from .._spec import ModelSpec

__all__ = ["AudioLMSpec"]


_AUDIO_KEYS = ("input_features", "audio_feature_lens", "audio_frames", "mm_token_type_ids")


class AudioLMSpec(ModelSpec):
    """An audio encoder + projector in front of a text decoder (Qwen2-Audio, Aero).

    The audio tower plays the part of the vision tower for lmms-parallel and the trainer: FSDP2
    per encoder block, activation checkpointing (``vision_activation_checkpointing``), freezing
    (``freeze: [vision_tower]``) and the dummy input that keeps a rank without audio in step.
    """

    media_keys = _AUDIO_KEYS
    host_keys = ("audio_feature_lens", "audio_frames", "mm_token_type_ids")
    #: the unpacked model's keyword arguments for padded windows and their frame mask (tests)
    reference_audio_keys = ("input_features", "feature_attention_mask")

    def audio_tower(self, model: nn.Module) -> nn.Module:
        return self.base_model(model).audio_tower

    def projector(self, model: nn.Module) -> nn.Module:
        return self.base_model(model).multi_modal_projector

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return self.audio_tower(model)

    def towers(self, model: nn.Module) -> dict[str, nn.Module | None]:
        return {"decoder": self.text_model(model), "audio": self.audio_tower(model)}

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(self.audio_tower(model).layers)

    def dummy_vision_inputs(self, model: nn.Module, device: torch.device) -> dict[str, Any]:
        return dummy_audio_inputs(self.audio_tower(model), device)

    def media_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return varlen_audio_forward(self.audio_tower(model), self.projector(model))

    def merge_media(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run the (varlen) audio tower with the projector, place the features at the audio
        placeholders; the base model then gets ``inputs_embeds`` only."""
        rest = {k: v for k, v in inputs.items() if k not in _AUDIO_KEYS}
        feats = inputs.get("input_features")
        if feats is None:
            return rest
        tower = self.audio_tower(model)
        impl = getattr(tower.config, "_attn_implementation", "")
        if impl in ("eager", "sdpa"):
            raise NotImplementedError(
                f"the packed audio encoder needs an lmms varlen attention backend (its clips are "
                f"concatenated), not {impl!r}: set vision_attn_backend to a varlen backend"
            )
        embeds = self.base_model(model).get_input_embeddings()(rest.pop("input_ids"))  # [1, T, H]
        audio = tower(
            input_features=feats,
            feature_lens=inputs["audio_feature_lens"],
            audio_frames=inputs["audio_frames"],
        )  # [N, H]: encoder and projector (see varlen_audio_forward)
        types = inputs["mm_token_type_ids"]
        return {**rest, "inputs_embeds": merge_audio(embeds, types.cpu(), audio)}

    def media_flops(self, config: Any, batch: dict[str, Any]) -> float:
        lens = batch.get("audio_feature_lens")
        if lens is None or not len(lens):
            return 0.0
        hidden = _flops._get(self.text_config(config), "hidden_size")
        return whisper_encoder_flops(config.audio_config, lens, out_hidden=hidden)
