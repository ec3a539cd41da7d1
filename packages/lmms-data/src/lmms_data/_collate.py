"""``collate_packed_batch``: one pack of samples -> the packed batch the model consumes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lmms_pack import collate_packed

#: media keys concatenated along dim 0 in pack order
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
              "second_per_grid_ts", "input_features", "audio_feature_lens",
              "audio_frames", "image_sizes", "batch_num_images", "video_frames")  # fmt: skip


def collate_packed_batch(
    samples: Sequence[Mapping[str, Any]], *, as_torch: bool = True, **pack_options: Any
) -> dict[str, Any]:
    """``lmms_pack.collate_packed`` (``pack_options``: its ``pad_to_multiple_of``,
    ``pad_token_id``) plus the samples' media tensors concatenated in pack order,
    ``mm_token_type_ids [T]`` (when any sample has it; padding is 0) and ``vision_tokens`` (int).

    Returns CPU torch tensors (``as_torch=False``: numpy). See docs/contracts.md, "packed batch".
    Samples of a processor that leaves packing to the model (``parts``: BAGEL) become a row of
    parts instead (``lmms_data.processors.collate_parts``).
    """
    if samples and "parts" in samples[0]:
        from lmms_data.processors import collate_parts

        return collate_parts(samples)
    row: dict[str, Any] = collate_packed(samples, **pack_options)
    T = row["input_ids"].shape[0]
    for key in MEDIA_KEYS:
        vals = [np.asarray(s[key]) for s in samples if s.get(key) is not None]
        if vals:
            row[key] = np.concatenate(vals)
    if any(s.get("mm_token_type_ids") is not None for s in samples):
        mm = np.zeros(T, dtype=np.int64)
        off = 0
        for s in samples:
            n = int(s["length"])
            if s.get("mm_token_type_ids") is not None:
                mm[off : off + n] = s["mm_token_type_ids"]
            off += n
        row["mm_token_type_ids"] = mm
    if any(s.get("ref_logps") is not None for s in samples):  # preference pairs (DPO)
        if not all(s.get("ref_logps") is not None for s in samples):
            raise ValueError("some preference pairs of a pack carry ref_logps and some do not")
        row["ref_logps"] = np.concatenate([np.asarray(s["ref_logps"]) for s in samples])
    row["vision_tokens"] = int(sum(int(s.get("vision_tokens", 0)) for s in samples))
    if any("audio_tokens" in s for s in samples):
        row["audio_tokens"] = int(sum(int(s.get("audio_tokens", 0)) for s in samples))
    if not as_torch:
        return row
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "torch tensors from collate_packed_batch need torch: pip install 'lmms-data[torch]'"
        ) from exc

    return {k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for k, v in row.items()}  # fmt: skip
