"""Qwen3-Omni-MoE thinker samples: Qwen2.5-Omni's layout (chat messages with text, image, video
and audio parts; placeholders bracketed by vision / audio markers; ``[4, L]`` TMRoPE positions)
with the Qwen3-Omni audio encoder's clip-to-token rule: every ``2·n_window``-frame chunk (and
the remainder) through three stride-2 convolutions (``13`` tokens per full 100-frame chunk).

Not supported (a clear error instead): ``use_audio_in_video``. Qwen3-Omni interleaves a
video's frames and its sound track token by token by TMRoPE time, not in Qwen2.5-Omni's 2 s
chunks; that layout is not implemented here. Video time positions are truncated to integers
(Qwen2.5-Omni's rule); upstream's Qwen3-Omni keeps ``t · second_per_grid · position_id_per_seconds``
as a float, so the two agree when that product is integral (e.g. 2 s per temporal patch at 25).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmms_data._registry import register_processor
from lmms_data.processors._omni import Qwen2_5OmniDataProcessor


def omni3_audio_tokens(frames: np.ndarray, n_window: int = 50) -> np.ndarray:
    """Qwen3-Omni audio-encoder outputs per clip of ``frames [n]`` mel frames."""
    frames = np.asarray(frames, dtype=np.int64)
    chunk = 2 * n_window

    def down(n: np.ndarray) -> np.ndarray:  # three stride-2 convolutions, kernel 3, padding 1
        for _ in range(3):
            n = (n - 1) // 2 + 1
        return n

    rest = frames % chunk
    return np.where(rest > 0, down(rest), 0) + (frames // chunk) * down(np.int64(chunk))


@register_processor("qwen3_omni_moe")
class Qwen3OmniMoeDataProcessor(Qwen2_5OmniDataProcessor):
    """Options: Qwen2.5-Omni's (``position_id_per_seconds`` must equal the model config's) and
    ``audio_n_window`` (50: the audio config's ``n_window``)."""

    family = "qwen3_omni_moe"

    def __init__(self, processor: Any, **options: Any) -> None:
        self.n_window = int(options.pop("audio_n_window", 50))
        super().__init__(processor, **options)
        if self.use_audio_in_video:
            raise ValueError(
                "qwen3_omni_moe: use_audio_in_video is not supported (Qwen3-Omni interleaves a "
                "video and its sound track by TMRoPE time, a layout lmms-data does not build yet)"
            )

    def audio_tokens(self, frames: np.ndarray) -> np.ndarray:
        return omni3_audio_tokens(frames, self.n_window)
