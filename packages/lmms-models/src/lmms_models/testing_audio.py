"""The unpacked reference harness of the audio families (see :mod:`lmms_models.testing`).

A synthetic audio sample holds clips of given valid mel-frame counts: each clip is a random
``[n_mels, window]`` log-mel window (the padding region random too, so a packed path that read
past what it may would show), and the sample's text has one run of audio placeholders per audio
part, as many as upstream's formula gives. The reference runs each sample alone through the
upstream model with the padded windows and ``feature_attention_mask`` (upstream's own encoder,
masks, merge and loss); the packed batch carries what lmms-data's audio processors emit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._audio import AUDIO_TYPE_ID, whisper_lengths
from ._spec import IGNORE_INDEX, ModelSpec
from .parts.audio_lm import AudioLMSpec
from .parts.omni_audio import OmniAudioPart
from .testing import pack_rows, upstream_loss_sum

__all__ = [
    "AudioSampleSpec",
    "OmniSampleSpec",
    "audio_reference_loss_sum",
    "make_audio_sample",
    "make_omni_sample",
    "pack_audio_samples",
]

_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                "second_per_grid_ts")  # fmt: skip


@dataclass(kw_only=True, slots=True)
class AudioSampleSpec:
    """Text lengths around the audio, each audio part as a list of clips' valid frame counts
    (several clips: one long audio chunked into one placeholder run), the unsupervised prompt."""

    text: int = 8
    audios: Sequence[Sequence[int]] = ()
    prompt: int = 2
    extra: dict[str, Any] = field(default_factory=dict)


def _context(frames: int, window: int) -> int:
    """Frames kept per clip: the valid ones plus the 2 padding frames the convolutions read."""
    return min(frames + 2, window)


def make_audio_sample(
    spec: ModelSpec, config: Any, s: AudioSampleSpec, *, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One sample: ``input_ids [L]``, ``labels [L]``, the padded windows and masks for the
    upstream call (``ref_features [n, M, W]``, ``ref_mask [n, W]``) and the packed entries."""
    ac = config.audio_config
    window = 2 * ac.max_source_positions
    low = 1000
    ids: list[int] = torch.randint(0, low, (2 if s.audios else 0,), generator=gen).tolist()
    full, lens = [], []
    for clips in s.audios:
        n_tok = 0
        for frames in clips:
            full.append(torch.randn(ac.num_mel_bins, window, generator=gen))
            lens.append(frames)
            n_tok += int(whisper_lengths(torch.tensor(frames))[1])
        ids += [config.audio_token_id] * n_tok + torch.randint(0, low, (1,), generator=gen).tolist()
    ids += torch.randint(0, low, (s.text,), generator=gen).tolist()
    input_ids = torch.tensor(ids, dtype=torch.long)
    labels = input_ids.clone()
    labels[: s.prompt] = IGNORE_INDEX
    types = torch.where(input_ids == config.audio_token_id, AUDIO_TYPE_ID, 0)
    labels[types != 0] = IGNORE_INDEX
    out: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "mm_token_type_ids": types}
    if full:
        lens_t = torch.tensor(lens)
        out["ref_features"] = torch.stack(full)  # [n, M, W]
        out["ref_mask"] = (torch.arange(window)[None] < lens_t[:, None]).long()  # [n, W]
        kept = torch.tensor([_context(f, window) for f in lens])
        out["input_features"] = torch.cat([f[:, :k].T for f, k in zip(full, kept.tolist())])
        out["audio_feature_lens"] = lens_t
        out["audio_frames"] = kept
    return out


def pack_audio_samples(
    spec: ModelSpec, model: nn.Module, samples: Sequence[dict[str, Any]], *, pad_to: int = 0
) -> dict[str, Any]:
    """Concatenate ``samples`` into one packed batch (:func:`~lmms_models.testing.pack_rows`),
    positions per sample from ``spec.sample_position_ids`` with each sample's ``position_media``,
    media in pack order (the audio entries, and for omni models the vision entries too)."""
    positions = [
        spec.sample_position_ids(model, s["input_ids"], **s.get("position_media", {}))
        for s in samples
    ]
    batch = pack_rows(samples, positions, pad_to=pad_to)
    types = torch.cat([s["mm_token_type_ids"] for s in samples])
    batch["mm_token_type_ids"] = F.pad(types, (0, batch["input_ids"].numel() - types.numel()))
    for key in (*_VISION_KEYS, "input_features", "audio_feature_lens", "audio_frames"):
        vals = [s[key] for s in samples if key in s]
        if vals:
            batch[key] = torch.cat(vals)
    batch["audio_tokens"] = int((batch["mm_token_type_ids"] == AUDIO_TYPE_ID).sum())
    return batch


def audio_reference_loss_sum(
    spec: AudioLMSpec | OmniAudioPart, model: nn.Module, samples: Sequence[dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, int]:
    """Σ over samples of (upstream mean loss × supervised tokens), and the token count
    (:func:`~lmms_models.testing.upstream_loss_sum` with each sample's padded audio windows and
    ``ref_kwargs``)."""
    feats, mask = spec.reference_audio_keys

    def media(s: dict[str, Any]) -> dict[str, Any]:
        out = {feats: s["ref_features"], mask: s["ref_mask"]} if "ref_features" in s else {}
        return {**out, **s.get("ref_kwargs", {})}

    return upstream_loss_sum(model, samples, media)


@dataclass(kw_only=True, slots=True)
class OmniSampleSpec:
    """An omni sample: text, images and videos as patch grids ``(t, h, w)``, standalone audios
    as valid mel-frame counts, and ``video_audio``: each video's own sound track (its frame
    count), interleaved with the video (``use_audio_in_video``) in ``seconds_per_chunk`` runs
    (Qwen2.5-Omni) or token by token in TMRoPE time (a spec whose ``audio_in_video`` is
    ``"tokens"``: Qwen3-Omni)."""

    text: int = 6
    images: Sequence[tuple[int, int, int]] = ()
    videos: Sequence[tuple[int, int, int]] = ()
    audios: Sequence[int] = ()
    video_audio: Sequence[int] = ()
    second_per_grid: float = 1.0
    prompt: int = 2


def _chunks(values: torch.Tensor, per_chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of ``values`` whose values fall in successive windows of
    ``per_chunk`` (the interleaving rule of upstream's Qwen2.5-Omni processor)."""
    out, start, chunk = [], 0, 1
    for i, v in enumerate(values.tolist()):
        if v >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(values)))
    return out


def _merge_by_time(video_keys: list[float], n_audio: int, video: int, audio: int) -> list[int]:
    """Qwen3-Omni's interleaving (upstream processor's rule): the next video token goes first
    while its TMRoPE time is ``<=`` the next audio token's index; the rest of either follows."""
    out, v, a = [], 0, 0
    while v < len(video_keys) and a < n_audio:
        if video_keys[v] <= a:
            out.append(video)
            v += 1
        else:
            out.append(audio)
            a += 1
    return out + [video] * (len(video_keys) - v) + [audio] * (n_audio - a)


def make_omni_sample(
    spec: OmniAudioPart, config: Any, s: OmniSampleSpec, *, gen: torch.Generator
) -> dict[str, Any]:
    """One Qwen2.5-Omni / Qwen3-Omni sample in the layout of upstream's processor; ``ref_kwargs`` holds the
    upstream call's media, ``position_media`` what :meth:`sample_position_ids` needs."""
    vc, ac = config.vision_config, config.audio_config
    merge2 = vc.spatial_merge_size**2
    per_patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    as_, ae = config.audio_start_token_id, config.audio_end_token_id
    rand = lambda n: torch.randint(0, 1000, (n,), generator=gen).tolist()  # noqa: E731
    ids: list[int] = rand(2)
    pix, vid, clips = [], [], []
    for t, h, w in s.images:
        ids += [vs] + [config.image_token_id] * (t * h * w // merge2) + [ve] + rand(1)
        pix.append(torch.randn(t * h * w, per_patch, generator=gen))
    for i, (t, h, w) in enumerate(s.videos):
        vid.append(torch.randn(t * h * w, per_patch, generator=gen))
        n_vid = t * h * w // merge2
        if not s.video_audio:
            ids += [vs] + [config.video_token_id] * n_vid + [ve] + rand(1)
            continue
        frames = s.video_audio[i]
        clips.append(frames)
        n_aud = int(spec.audio_token_lengths(torch.tensor([frames]), ac)[0])
        ids += [vs, as_, *_video_with_audio(spec, config, s, t, n_vid, n_aud), ae, ve, *rand(1)]
    for frames in s.audios:
        clips.append(frames)
        n_aud = int(spec.audio_token_lengths(torch.tensor([frames]), ac)[0])
        ids += [as_] + [config.audio_token_id] * n_aud + [ae] + rand(1)
    ids += rand(s.text)
    return _omni_entries(config, s, torch.tensor(ids, dtype=torch.long), pix, vid, clips, gen)


def _video_with_audio(
    spec: OmniAudioPart, config: Any, s: OmniSampleSpec, t: int, n_vid: int, n_aud: int
) -> list[int]:
    """The placeholders of a video of ``t`` frames (``n_vid`` tokens) interleaved with its sound
    track's ``n_aud``: token by token in TMRoPE time (Qwen3-Omni) or in runs of
    ``seconds_per_chunk`` (Qwen2.5-Omni)."""
    video, audio = config.video_token_id, config.audio_token_id
    if spec.audio_in_video == "tokens":
        keys = [i * s.second_per_grid * config.position_id_per_seconds for i in range(t)]
        return _merge_by_time([k for k in keys for _ in range(n_vid // t)], n_aud, video, audio)
    per = int(config.position_id_per_seconds * config.seconds_per_chunk)
    t_idx = (torch.arange(t) * s.second_per_grid * config.position_id_per_seconds).long()
    v_chunks = _chunks(t_idx.repeat_interleave(n_vid // t), per)
    a_chunks = _chunks(torch.arange(n_aud), per)
    ids: list[int] = []
    for j in range(max(len(v_chunks), len(a_chunks))):
        if j < len(v_chunks):
            ids += [video] * (v_chunks[j][1] - v_chunks[j][0])
        if j < len(a_chunks):
            ids += [audio] * (a_chunks[j][1] - a_chunks[j][0])
    return ids


def _omni_entries(
    config: Any,
    s: OmniSampleSpec,
    input_ids: torch.Tensor,
    pix: list[torch.Tensor],
    vid: list[torch.Tensor],
    clips: list[int],
    gen: torch.Generator,
) -> dict[str, Any]:
    """The sample of ``input_ids [L]``: labels, token types, packed media, and the upstream
    call's (``ref_kwargs``) and the positions' (``position_media``) entries."""
    ac = config.audio_config
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    as_, ae = config.audio_start_token_id, config.audio_end_token_id
    labels = input_ids.clone()
    labels[: s.prompt] = IGNORE_INDEX
    special = (config.image_token_id, config.video_token_id, config.audio_token_id, vs, ve, as_, ae)
    labels[torch.isin(input_ids, torch.tensor(special))] = IGNORE_INDEX
    types = torch.zeros_like(input_ids)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    types[input_ids == config.audio_token_id] = AUDIO_TYPE_ID
    out: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "mm_token_type_ids": types}
    ref: dict[str, Any] = {"attention_mask": torch.ones_like(input_ids)[None]}
    media: dict[str, Any] = {}
    if pix:
        out["pixel_values"] = ref["pixel_values"] = torch.cat(pix)
        out["image_grid_thw"] = media["image_grid_thw"] = torch.tensor(list(s.images))
        ref["image_grid_thw"] = out["image_grid_thw"]
    if vid:
        out["pixel_values_videos"] = ref["pixel_values_videos"] = torch.cat(vid)
        out["video_grid_thw"] = media["video_grid_thw"] = torch.tensor(list(s.videos))
        ref["video_grid_thw"] = out["video_grid_thw"]
        spg = torch.full((len(s.videos),), s.second_per_grid)
        out["second_per_grid_ts"] = media["second_per_grid_ts"] = spg
        ref["video_second_per_grid"] = spg
    if clips:
        lens = torch.tensor(clips)
        window = int(lens.max())
        full = [torch.randn(ac.num_mel_bins, window, generator=gen) for _ in clips]
        ref["input_features"] = torch.stack(full)  # [n, M, W]
        ref["feature_attention_mask"] = (torch.arange(window)[None] < lens[:, None]).long()
        out["input_features"] = torch.cat([f[:, :n].T for f, n in zip(full, clips)])
        out["audio_feature_lens"] = out["audio_frames"] = media["audio_feature_lens"] = lens
    if s.video_audio:
        ref["use_audio_in_video"] = media["use_audio_in_video"] = True
    out["ref_kwargs"], out["position_media"] = ref, media
    return out
