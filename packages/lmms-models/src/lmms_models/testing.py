"""The unpacked reference harness: synthetic samples, a packer, and the upstream per-sample loss.

Parity tests (here and in other packages) use it to check that a packed forward equals the sum,
over samples, of the upstream model's own unpacked forward (``model(input_ids=..., labels=...,
pixel_values=..., ...)``, which computes its own positions and loss). Samples are built without
the data package: text tokens are random ids below the special ids, media are random
``pixel_values`` of the right shape with as many placeholder tokens as the grid merges into.

The packer here is deliberately naive (concatenate in order); lmms-pack is the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._capabilities import OwnTestSamples, TokenTypes
from ._rows import shift_labels_packed
from ._spec import IGNORE_INDEX, ModelSpec

__all__ = [
    "SampleSpec",
    "make_sample",
    "pack_rows",
    "pack_samples",
    "reference_loss_sum",
    "upstream_loss_sum",
]


@dataclass(kw_only=True, slots=True)
class SampleSpec:
    """What one synthetic sample holds: text lengths around the media, images and videos as
    ``(t, h, w)`` patch grids (``h``, ``w`` multiples of the merge size; ``t`` in temporal patches),
    and how many leading tokens are unsupervised (the "prompt")."""

    text: int = 8
    images: Sequence[tuple[int, int, int]] = ()
    videos: Sequence[tuple[int, int, int]] = ()
    prompt: int = 2
    extra: dict[str, Any] = field(default_factory=dict)


def _rand_text(n: int, high: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, high, (n,), generator=gen).tolist()


def make_sample(
    spec: ModelSpec, config: Any, s: SampleSpec, *, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One sample dict (``input_ids [L]``, ``labels [L]`` and media) for ``spec``'s model.

    Media blocks are ``<vision_start> <pad>*n <vision_end>``; Qwen3-VL videos get one such block
    per temporal patch (its processor separates frames with timestamps), Qwen2.5-VL one per video.
    """
    if isinstance(spec, OwnTestSamples):  # a family whose media are not Qwen grids
        return spec.make_test_sample(config, s, gen=gen)
    text_cfg = spec.text_config(config)
    ids: list[int] = []
    out: dict[str, Any] = {}
    if s.images or s.videos:
        vc = config.vision_config
        low = min(config.image_token_id, config.video_token_id, config.vision_start_token_id)
        merge2 = vc.spatial_merge_size**2
        per_patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        start, end = config.vision_start_token_id, config.vision_end_token_id
        split_frames = spec.processor_family == "qwen3_vl"
        pix: list[torch.Tensor] = []
        for t, h, w in s.images:
            ids += (
                _rand_text(2, low, gen) + [start] + [config.image_token_id] * (t * h * w // merge2)
            )
            ids += [end]
            pix.append(torch.randn(t * h * w, per_patch, generator=gen))
        if s.images:
            out["pixel_values"] = torch.cat(pix)
            out["image_grid_thw"] = torch.tensor(list(s.images), dtype=torch.long)
        vid: list[torch.Tensor] = []
        for t, h, w in s.videos:
            frames = t if split_frames else 1
            for _ in range(frames):
                ids += [*_rand_text(1, low, gen), start]
                ids += [config.video_token_id] * (t * h * w // merge2 // frames) + [end]
            vid.append(torch.randn(t * h * w, per_patch, generator=gen))
        if s.videos:
            out["pixel_values_videos"] = torch.cat(vid)
            out["video_grid_thw"] = torch.tensor(list(s.videos), dtype=torch.long)
        ids += _rand_text(s.text, low, gen)
    else:
        ids = _rand_text(s.text, min(text_cfg.vocab_size, 1000), gen)
    input_ids = torch.tensor(ids, dtype=torch.long)
    labels = input_ids.clone()
    labels[: s.prompt] = IGNORE_INDEX
    if s.images or s.videos:
        special = (config.image_token_id, config.video_token_id, start, end)
        labels[torch.isin(input_ids, torch.tensor(special))] = IGNORE_INDEX
    out.update(input_ids=input_ids, labels=labels)
    return out


def pack_rows(
    samples: Sequence[dict[str, torch.Tensor]],
    positions: Sequence[torch.Tensor],
    *,
    pad_to: int = 0,
) -> dict[str, Any]:
    """The text part of a packed batch (docs/contracts.md): ``samples``' ids and labels, their
    next-token labels within each sample, their ``positions`` (``[P, n]`` each) and segments.
    ``pad_to`` > total adds a tail padding segment."""
    ids = [s["input_ids"] for s in samples]
    labels = [s["labels"] for s in samples]
    pos, lens = list(positions), [int(i.numel()) for i in ids]
    pad = pad_to - sum(lens)
    if pad > 0:
        dev = ids[0].device
        ids.append(torch.zeros(pad, dtype=torch.long, device=dev))
        labels.append(torch.full((pad,), IGNORE_INDEX, device=dev))
        pos.append(torch.arange(pad, device=dev).expand(pos[0].shape[0], -1))
        lens.append(pad)
    position_ids = torch.cat(pos, -1)
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    batch: dict[str, Any] = {
        "input_ids": torch.cat(ids),
        "labels": torch.cat(labels),
        "shift_labels": shift_labels_packed(torch.cat(labels), cu_seqlens),
        "position_ids": position_ids[0] if position_ids.shape[0] == 1 else position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(lens),
        "num_samples": len(samples),
    }
    batch["num_loss_tokens"] = int((batch["shift_labels"] != IGNORE_INDEX).sum())
    return batch


def pack_samples(
    spec: ModelSpec,
    model: nn.Module,
    samples: Sequence[dict[str, torch.Tensor]],
    *,
    pad_to: int = 0,
) -> dict[str, Any]:
    """Concatenate ``samples`` into one packed batch (:func:`pack_rows`), positions computed per
    sample with the upstream ``get_rope_index`` (the data package does this at run time)."""
    grids = ("image_grid_thw", "video_grid_thw")
    positions = [
        spec.sample_position_ids(model, s["input_ids"], **{k: s.get(k) for k in grids})
        for s in samples
    ]
    batch = pack_rows(samples, positions, pad_to=pad_to)
    for key in spec.media_keys:
        vals = [s[key] for s in samples if key in s and key != "mm_token_type_ids"]
        if vals:
            batch[key] = torch.cat(vals)
    if isinstance(spec, TokenTypes):
        batch["mm_token_type_ids"] = spec.mm_token_type_ids(model.config, batch["input_ids"])
    return batch


def reference_loss_sum(
    spec: ModelSpec, model: nn.Module, samples: Sequence[dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, int]:
    """Σ over samples of (upstream mean loss × supervised tokens), and the token count
    (:func:`upstream_loss_sum`; the media: the family's ``reference_media``, or the Qwen-VL
    entries, with the token types where positions have several rows)."""

    def media(s: dict[str, Any]) -> dict[str, Any]:
        if isinstance(spec, OwnTestSamples):  # the upstream call's media arguments
            return spec.reference_media(s)
        out = {k: s[k] for k in _VL_MEDIA if k in s}
        if spec.position_rows > 1:  # mRoPE: the Qwen-VL lineage, a TokenTypes family
            out["mm_token_type_ids"] = spec.mm_token_type_ids(model.config, s["input_ids"][None])  # type: ignore[attr-defined]
        return out

    return upstream_loss_sum(model, samples, media)


_VL_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def upstream_loss_sum(
    model: nn.Module,
    samples: Sequence[dict[str, Any]],
    media: Callable[[dict[str, Any]], dict[str, Any]],
) -> tuple[torch.Tensor, int]:
    """Σ over samples of (upstream mean loss × supervised tokens), and the token count.

    Each sample runs alone through the upstream ``model(...)`` with ``labels`` (the upstream loss,
    positions and media handling) and ``media(sample)``'s arguments. Samples without a
    supervised next token add nothing.
    """
    total = torch.zeros(())
    count = 0
    for s in samples:
        n = int((s["labels"][1:] != IGNORE_INDEX).sum())
        if n == 0:
            continue
        out = model(
            input_ids=s["input_ids"][None], labels=s["labels"][None], use_cache=False, **media(s)
        )
        total = total + out.loss.float() * n
        count += n
    return total, count
