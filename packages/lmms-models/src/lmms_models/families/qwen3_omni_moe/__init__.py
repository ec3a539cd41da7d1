"""Qwen3-Omni-MoE thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``): the text-generating
part of Qwen3-Omni (talker and code2wav are not trained). The Qwen3-VL vision tower with
deepstack, an audio encoder of three stride-2 2-D convolutions over ``2·n_window``-frame chunks
followed by transformer blocks attending within ``n_window_infer``-frame windows (varlen by
construction), and a Qwen3-MoE decoder (top-k routed experts, router aux loss) with TMRoPE:
``[4, T]`` float32 positions (text row + 3 interleaved M-RoPE rows), video time at
``position_id_per_seconds`` kept fractional as upstream computes it; with ``use_audio_in_video``
a video's frames and its sound track interleave token by token in TMRoPE time.

Composed of three parts, none re-implemented:

* audio, TMRoPE positions, the two-tower participation order:
  :class:`~lmms_models.parts.omni_audio.OmniAudioPart` (only the tower call, its host-precomputed
  inputs and the clip-to-token rule differ);
* vision with deepstack at host positions: :class:`~lmms_models.parts.qwen3_vision.Qwen3VisionPart`;
* everything sparse: :class:`lmms_models.MoESpecMixin`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ... import _flops
from ..._moe import MoESpecMixin
from ..._registry import register_model
from ..._spec import to_device
from ..._vl import merge_tiny
from ...parts.omni_audio import OmniAudioPart
from ...parts.qwen2_5_vision import vit_tower_shape
from ...parts.qwen3_vision import QWEN3_VL_30B_A3B, Qwen3VisionPart
from ...parts.qwen3_vision import QWEN3_VL_TINY as _QWEN3_VL_TINY
from ...parts.text import prepared_empty_mask

__all__ = ["QWEN3_OMNI_30B_A3B", "Qwen3OmniMoeSpec", "omni3_audio_tokens"]

_MODULE = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"

#: Qwen3-Omni-30B-A3B's thinker shape (random weights: benchmarks and GPU examples): the
#: Qwen3-VL-30B-A3B decoder and vision tower, a 32-layer 1280-wide audio encoder projecting to 2048.
#: Sources, checked 2026-12 (no hub access here): the released thinker_config as quoted in public
#: tests that mirror it (a Qwen3-Omni thinker-extraction tool's test: vocab 152064, hidden 2048,
#: 48 layers, rope_theta 1e6, 65536 positions, mrope 24/20/20 interleaved, 128 experts; ViT depth
#: 27, 1152 wide, deepstack 8/16/24, 768 px / 16 px patches -> 2304 positions, out 2048; token
#: ids; 13 positions per second. NVIDIA's HF-to-Megatron Qwen3-Omni toy config keeps the released audio
#: encoder: 1280 wide, 32 layers, 20 heads, 5120, n_window 50, n_window_infer 800, 480-channel
#: downsampling, conv_chunksize 500, output 2048; 2 s chunks); 32/4 heads of 128, 8 of 128
#: experts 768 wide: the Qwen3-30B-A3B decoder the release names (keras-hub's preset note).
QWEN3_OMNI_30B_A3B: dict[str, Any] = {
    "text_config": {
        **QWEN3_VL_30B_A3B["text_config"], "vocab_size": 152064,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        "max_position_embeddings": 65536,
    },
    "vision_config": {**QWEN3_VL_30B_A3B["vision_config"]},
    "audio_config": {
        "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500,
        "n_window": 50, "n_window_infer": 800, "downsample_hidden_size": 480,
        "output_dim": 2048, "conv_chunksize": 500,
    },
    "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
    "audio_start_token_id": 151669, "audio_end_token_id": 151670,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "position_id_per_seconds": 13, "seconds_per_chunk": 2, "tie_word_embeddings": False,
}  # fmt: skip

_TINY: dict[str, Any] = {
    **merge_tiny(
        _QWEN3_VL_TINY,
        {
            "text_config": {
                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
            }
        },
    ),
    "audio_config": {
        "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
        "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 50,
        "n_window_infer": 200, "downsample_hidden_size": 8, "output_dim": 64,
        "conv_chunksize": 500,
    },
    "audio_token_id": 1006, "audio_start_token_id": 1007, "audio_end_token_id": 1008,
    "position_id_per_seconds": 13, "seconds_per_chunk": 2, "tie_word_embeddings": False,
}  # fmt: skip


def omni3_audio_tokens(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio-encoder outputs per clip of ``frames [n]`` mel frames: every full ``2·n_window``
    chunk gives the length after three stride-2 convolutions of the full chunk, the remainder
    chunk likewise (the same rule as upstream's ``_get_feat_extract_output_lengths``)."""
    frames = torch.as_tensor(frames).long()
    chunk = 2 * n_window
    down = lambda n: (((n - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1  # noqa: E731
    rest = frames % chunk
    return torch.where(rest > 0, down(rest), 0) + (frames // chunk) * down(torch.tensor(chunk))


@register_model("qwen3_omni_moe")
class Qwen3OmniMoeSpec(MoESpecMixin, OmniAudioPart, Qwen3VisionPart):
    processor_family = "qwen3_omni_moe"
    #: Liger (lmms_kernels.apply_liger): decoder norms (incl. q/k) and the final norm; the towers'
    #: LayerNorm/GELU stay upstream
    liger_plan = {  # noqa: RUF012
        "rms_norm": ("Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3OmniMoeTextRMSNorm"),
        "mlp": ("Qwen3OmniMoeThinkerTextMLP",),
        "rms_casting": "llama",  # w * (x_fp32 * rstd).to(dtype)
        "mlp_optional": True,
    }
    config_class = "Qwen3OmniMoeThinkerConfig"
    model_class = "Qwen3OmniMoeThinkerForConditionalGeneration"
    folder_model_types = ("qwen3_omni_moe_thinker",)  # a thinker-only folder (the export)
    #: ``t · second_per_grid · position_id_per_seconds`` kept as upstream computes it (float32;
    #: the rotary embedding takes float positions; lmms-data emits the same rows, tested equal)
    fractional_positions = True
    aux_loss_module = "qwen3_omni_moe"
    mrope_rows_only = False  # [4, T]: the text model reads the text row itself
    #: Its decoder has no ``{layer type: mask}`` branch: the empty prepared mask of Qwen3-MoE.
    mask_mapping = False
    presets = {"30b_a3b": QWEN3_OMNI_30B_A3B}  # noqa: RUF012
    audio_in_video = "tokens"

    #: the pack's grids and token types stay on the host (Qwen3-VL's host vision inputs); the
    #: audio lengths are read to the host where used (as before the parts split)
    host_keys = Qwen3VisionPart.host_keys

    def memory_towers(self, config: Any) -> dict[str, Any]:
        """The decoder and the ViT counted as a SwiGLU tower of its shape (:func:`vit_tower_shape`,
        the count this family had before the parts split; its ViT's MLP is GELU: a slight
        over-count of the ViT's activations)."""
        return {**super().memory_towers(config), "vision": vit_tower_shape(config)}

    @contextlib.contextmanager
    def media_context(self, model: nn.Module) -> Iterator[None]:
        """Qwen3-VL's (tower hook, deepstack by index) and the empty prepared mask."""
        with (
            Qwen3VisionPart.media_context(self, model),
            prepared_empty_mask(self.text_model(model)),
        ):
            yield

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)

    def audio_token_lengths(self, frames: torch.Tensor, audio_config: Any) -> torch.Tensor:
        """Text placeholders per clip of ``frames [n]`` mel frames."""
        return omni3_audio_tokens(frames, _flops._get(audio_config, "n_window"))

    def run_audio_tower(
        self, tower: nn.Module, features: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """``features [M, F]`` (mel bins, concatenated valid frames), host ``lens [n]`` ->
        ``[N, H]``, the chunking and windows computed on the host (:meth:`host_audio_inputs`)."""
        extra = self.host_audio_inputs(tower, features, lens)
        if "aftercnn_lens" in inspect.signature(tower.forward).parameters:  # older layouts
            n_window = tower.config.n_window
            extra["aftercnn_lens"] = to_device(omni3_audio_tokens(lens, n_window), features.device)
        return tower(
            input_features=features, feature_lens=to_device(lens, features.device), **extra
        ).last_hidden_state

    def dummy_audio(self, tower: nn.Module, device: torch.device) -> torch.Tensor:
        """The smallest clip (8 frames, one token) through every tower parameter."""
        mels = tower.config.num_mel_bins
        return self.run_audio_tower(tower, torch.zeros(mels, 8, device=device), torch.tensor([8]))

    def host_audio_inputs(
        self, tower: nn.Module, features: torch.Tensor, lens: torch.Tensor
    ) -> dict[str, Any]:
        """What the tower derives from ``feature_lens``, from the host ``lens [n]``: chunk
        lengths (upstream's rule: ``2·n_window`` frames, the remainder last), the chunks padded
        on the device (split by those host lengths), and the valid indices and window
        ``cu_seqlens`` by transformers' own helpers. The tower takes them precomputed where the
        installed transformers has these helpers (empty otherwise: it derives them itself)."""
        module = importlib.import_module(_MODULE)
        helpers = ("chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens")
        if not all(hasattr(module, h) for h in helpers):
            return {}
        n_window, dev = tower.n_window, features.device
        chunk_num = (lens + 2 * n_window - 1) // (2 * n_window)
        chunks = torch.full((int(chunk_num.sum()),), 2 * n_window, dtype=torch.long)
        tails = chunk_num.cumsum(0) - 1
        rest = lens % (2 * n_window)
        chunks[tails] = torch.where(rest == 0, 2 * n_window, rest)
        pieces = features.T.split(chunks.tolist(), dim=0)
        padded = nn.utils.rnn.pad_sequence(pieces, batch_first=True).transpose(1, 2)
        cu = module.get_audio_cu_seqlens(chunks, lens, tower.n_window_infer, n_window)
        return {
            "padded_feature": padded,  # [chunks, M, longest chunk]
            "chunk_lengths": to_device(chunks, dev),
            "valid_indices": to_device(module.get_valid_indices(chunks, n_window), dev),
            "cu_seqlens": to_device(cu, dev),
            "max_seqlen": int((cu[1:] - cu[:-1]).max()),
        }

    def media_flops(self, config: Any, batch: dict[str, Any]) -> float:
        """Vision (Qwen3-VL) plus the audio tower at ``6·N`` per output token over its matrix
        parameters (the convolutions counted per output position they produce)."""
        total = Qwen3VisionPart.media_flops(self, config, batch)
        lens = batch.get("audio_feature_lens")
        if lens is None or not len(lens):
            return total
        ac = config.audio_config
        g = lambda k: _flops._get(ac, k)  # noqa: E731
        d, ffn, layers = g("d_model"), g("encoder_ffn_dim"), g("encoder_layers")
        c, f1 = g("downsample_hidden_size"), (g("num_mel_bins") + 1) // 2
        f2, tokens = (
            (f1 + 1) // 2,
            float(omni3_audio_tokens(torch.as_tensor(lens), g("n_window")).sum()),
        )
        f3 = (f2 + 1) // 2
        # per output token: the blocks, conv_out, proj1, proj2; the three 3x3 convolutions at
        # 4, 2 and 1 time steps per token (stride 2 each) over f1, f2, f3 frequency rows
        per_token = layers * (4 * d * d + 2 * d * ffn) + c * f3 * d + d * d + d * g("output_dim")
        per_token += 9 * c * 4 * f1 + 9 * c * c * 2 * f2 + 9 * c * c * f3
        return total + 6.0 * per_token * tokens
