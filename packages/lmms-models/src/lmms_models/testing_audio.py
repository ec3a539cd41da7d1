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
from torch import nn

from ._audio import AUDIO_TYPE_ID, whisper_lengths
from ._spec import IGNORE_INDEX, ModelSpec
from .testing import pack_samples

__all__ = ["AudioSampleSpec", "audio_reference_loss_sum", "make_audio_sample", "pack_audio_samples"]


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
    spec: ModelSpec,
    model: nn.Module,
    samples: Sequence[dict[str, torch.Tensor]],
    *,
    pad_to: int = 0,
) -> dict[str, Any]:
    """:func:`lmms_models.testing.pack_samples` plus the audio entries in pack order."""
    batch = pack_samples(spec, model, samples, pad_to=pad_to)
    n = batch["input_ids"].numel()
    types = torch.zeros(n, dtype=torch.long)
    off = 0
    for s in samples:
        types[off : off + s["input_ids"].numel()] = s["mm_token_type_ids"]
        off += s["input_ids"].numel()
    batch["mm_token_type_ids"] = types
    for key in ("input_features", "audio_feature_lens", "audio_frames"):
        vals = [s[key] for s in samples if key in s]
        if vals:
            batch[key] = torch.cat(vals)
    batch["audio_tokens"] = int((types == AUDIO_TYPE_ID).sum())
    return batch


def audio_reference_loss_sum(
    spec: ModelSpec, model: nn.Module, samples: Sequence[dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, int]:
    """Σ over samples of (upstream mean loss × supervised tokens), and the token count."""
    total = torch.zeros(())
    count = 0
    for s in samples:
        n = int((s["labels"][1:] != IGNORE_INDEX).sum())
        if n == 0:
            continue
        kwargs: dict[str, Any] = {
            "input_ids": s["input_ids"][None],
            "labels": s["labels"][None],
            "use_cache": False,
        }
        if "ref_features" in s:
            kwargs["input_features"] = s["ref_features"]
            kwargs["feature_attention_mask"] = s["ref_mask"]
        out = model(**kwargs)
        total = total + out.loss.float() * n
        count += n
    return total, count
