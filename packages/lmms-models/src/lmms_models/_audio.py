"""Audio towers in the packed forward: the Whisper-style encoder of Qwen2-Audio (and Aero) on
varlen attention, without padding clips to the 30 s window, and the merge of audio features into
the text embeddings at placeholder positions read on the host.

Upstream's Qwen2-Audio encoder takes every clip padded to its 30 s window (3000 mel frames, 1500
positions after the stride-2 convolution) and masks the padding in attention. Here each clip
keeps its valid frames plus the 2 frames of the window's padding that its last convolution
outputs read (lmms-data's ``audio_frames``), the convolutions run on the clips (batched, zero
padded to the longest clip: outputs past a clip's valid length are dropped), the encoder layers
run on the concatenated valid positions with ``cu_seqlens`` per clip through the registered
varlen attention, and the stride-2 pooling pairs positions within each clip. Every kept value
equals upstream's: the masked keys contributed nothing, the dropped positions fed nothing kept,
and the position table is indexed per clip exactly as upstream slices it. A 2 s clip costs 100
encoder positions instead of 1500.

The varlen forward is installed on the tower instance for the duration of a packed forward
(:func:`varlen_audio_forward`) and removed afterwards, so the module is still upstream's outside;
calls go through ``tower(...)``, so FSDP's and lmms-parallel's hooks see the tower run.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._spec import to_device

__all__ = ["AUDIO_TYPE_ID", "merge_audio", "varlen_audio_forward", "whisper_lengths"]

#: ``mm_token_type_ids`` of audio placeholders (lmms-data's AUDIO_TYPE_ID)
AUDIO_TYPE_ID = 3


def whisper_lengths(feature_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions after the stride-2 convolution, tokens after the stride-2 pooling)`` of clips
    with ``feature_lens [n]`` valid mel frames (upstream's ``_get_feat_extract_output_lengths``)."""
    after_conv = (feature_lens - 1) // 2 + 1
    return after_conv, (after_conv - 2) // 2 + 1


def _whisper_varlen(
    tower: nn.Module,
    input_features: torch.Tensor,  # [F, n_mels]: clips' kept frames, concatenated
    feature_lens: torch.Tensor,  # [n] host: valid frames per clip
    audio_frames: torch.Tensor,  # [n] host: kept frames per clip
) -> torch.Tensor:  # [sum tokens, d_model]
    """Qwen2-Audio's encoder on varlen clips (see the module docstring); the tower's own modules."""
    if tower.training and getattr(tower, "layerdrop", 0.0) > 0:
        raise NotImplementedError("the varlen audio encoder does not implement encoder_layerdrop")
    lens = feature_lens.reshape(-1).cpu().long()
    frames = audio_frames.reshape(-1).cpu().long()
    after_conv, out_len = whisper_lengths(lens)  # [n], [n]
    window = 2 * tower.embed_positions.weight.shape[0]  # mel frames of upstream's window
    if (frames < torch.clamp(2 * after_conv + 1, max=window)).any():
        raise ValueError(
            "audio_frames must keep each clip's valid frames plus the 2 padding frames its last "
            "convolution reads (lmms-data's audio processors do)"
        )
    dev, dtype = tower.conv1.weight.device, tower.conv1.weight.dtype
    clips = input_features.to(dev, dtype).split(frames.tolist())  # n x [f_i, n_mels]
    x = nn.utils.rnn.pad_sequence(list(clips), batch_first=True).transpose(1, 2)  # [n, M, f]
    x = nn.functional.gelu(tower.conv1(x))
    x = nn.functional.gelu(tower.conv2(x)).transpose(1, 2)  # [n, S, D]
    # host indices of the valid positions, clip by clip
    clip_idx = torch.repeat_interleave(torch.arange(len(lens)), after_conv)  # [N]
    starts = torch.cumsum(after_conv, 0) - after_conv  # [n]
    pos = torch.arange(int(after_conv.sum())) - torch.repeat_interleave(starts, after_conv)  # [N]
    if int(after_conv.max()) > tower.embed_positions.weight.shape[0]:
        raise ValueError(
            f"an audio clip of {int(lens.max())} frames exceeds the encoder's "
            f"{tower.embed_positions.weight.shape[0]} positions"
        )
    clip_d, pos_d = to_device(clip_idx, dev), to_device(pos, dev)
    h = x[clip_d, pos_d] + tower.embed_positions.weight[pos_d]  # [N, D]
    h = nn.functional.dropout(h, p=tower.dropout, training=tower.training)[None]  # [1, N, D]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(after_conv, 0)
    longest = int(after_conv.max())
    attn = {"cu_seq_lens_q": to_device(cu, dev), "cu_seq_lens_k": to_device(cu, dev),
            "max_length_q": longest, "max_length_k": longest}  # fmt: skip
    for layer in tower.layers:
        h = layer(h, None, **attn)
    # stride-2 average pooling inside each clip: positions (2k, 2k+1), k < out_len
    pair_start = torch.repeat_interleave(starts, out_len)  # [K]
    k = torch.arange(int(out_len.sum())) - torch.repeat_interleave(
        torch.cumsum(out_len, 0) - out_len, out_len
    )
    even = to_device(pair_start + 2 * k, dev)
    h = h[0]
    pooled = (h.index_select(0, even) + h.index_select(0, even + 1)) / 2  # [K, D]
    return tower.layer_norm(pooled)


@contextlib.contextmanager
def varlen_audio_forward(tower: nn.Module | None, head: nn.Module | None = None) -> Iterator[None]:
    """While active, ``tower(input_features=[F, M], feature_lens=[n], audio_frames=[n])``
    returns the encoder's ``[tokens, d_model]`` on varlen clips, passed through ``head`` (the
    model's projector into the text width, which sits outside the upstream tower) when given;
    the instance's forward is restored on exit (upstream's class forward otherwise).

    The projector runs inside the tower call so that a rank without audio, which runs the tower
    on a dummy input (lmms_parallel.VisionParticipation), reaches the projector's parameters too:
    FSDP2 reduce-scatters the gradients its peers have, parameter for parameter."""
    if tower is None:
        yield
        return
    own = vars(tower).get("forward")

    def forward(
        self: nn.Module, input_features: torch.Tensor, feature_lens: torch.Tensor,
        audio_frames: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        out = _whisper_varlen(self, input_features, feature_lens, audio_frames)
        return out if head is None else head(out)

    tower.forward = types.MethodType(forward, tower)
    try:
        yield
    finally:
        if own is None:
            del tower.forward
        else:
            tower.forward = own


def dummy_audio_inputs(tower: nn.Module, device: torch.device) -> dict[str, Any]:
    """The smallest valid varlen tower input: one clip of 4 valid frames (1 token, 6 kept)."""
    m = tower.conv1.weight.shape[1]
    dtype = tower.conv1.weight.dtype
    return {
        "input_features": torch.zeros(6, m, device=device, dtype=dtype),
        "feature_lens": torch.tensor([4]),
        "audio_frames": torch.tensor([6]),
    }


def merge_audio(
    embeds: torch.Tensor,  # [1, T, H]
    types_host: torch.Tensor,  # [T] host mm_token_type_ids
    features: torch.Tensor,  # [N, H] projected audio features, in placeholder order
) -> torch.Tensor:  # [1, T, H]
    """Place audio features at the host-known audio placeholder positions (``index_copy``: no
    device read; the count check runs on the host)."""
    where = (types_host.reshape(-1) == AUDIO_TYPE_ID).nonzero().squeeze(1)  # host
    if where.numel() != features.shape[0]:
        raise ValueError(
            "audio features and audio placeholder tokens do not match: "
            f"{where.numel()} tokens, {features.shape[0]} features"
        )
    return embeds.index_copy(1, to_device(where, embeds.device), features.to(embeds.dtype)[None])


def whisper_encoder_flops(audio_config: Any, feature_lens: Any, *, out_hidden: int = 0) -> float:
    """Training FLOPs (``6·N`` per position plus attention) of a Whisper-style encoder on clips of
    ``feature_lens`` valid frames, as the varlen path runs it: the two convolutions (per frame and
    per position), ``encoder_layers`` blocks over each clip's positions, the projector to
    ``out_hidden`` (0: none) per output token. Conv work on the zero padding is not counted."""
    from ._flops import _get

    g = lambda k: _get(audio_config, k)  # noqa: E731
    d, ffn, mels, layers = (
        g("d_model"),
        g("encoder_ffn_dim"),
        g("num_mel_bins"),
        g("encoder_layers"),
    )
    lens = torch.as_tensor(feature_lens).reshape(-1).long()
    after_conv, out_len = whisper_lengths(lens)
    conv1 = 3 * mels * d + d  # per frame
    conv2 = 3 * d * d + d  # per position
    block = 4 * d * d + 3 * d + 2 * d * ffn + ffn + d + 4 * d  # attn (k has no bias), MLP, 2 LNs
    per_pos = conv2 + layers * block
    per_out = 2 * d + (d * out_hidden + out_hidden if out_hidden else 0)  # final LN, projector
    dense = conv1 * float(lens.sum()) + per_pos * float(after_conv.sum())
    dense += per_out * float(out_len.sum())
    attn = 12.0 * layers * d * float((after_conv.double() ** 2).sum())
    return 6.0 * dense + attn
