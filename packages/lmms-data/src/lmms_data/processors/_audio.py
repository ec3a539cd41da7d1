"""Qwen2-Audio processor: chat record with audio parts -> sample (ids, labels, log-mel features).

Audio parts (``{"type": "audio", "audio": PATH | bytes}``) are decoded by
:func:`lmms_data._audio.load_audio_clips` (mono, resampled with soxr to the feature extractor's
rate, long audio chunked / cut / refused by the options), and each clip goes through the model's
own feature extractor loaded from the processor folder (Whisper log-mel, padded to its 30 s
window exactly as the upstream processor calls it, so every value equals upstream's). The
tokenizer's chat template renders one ``<|AUDIO|>`` per audio part, which is expanded to the
number of tokens the encoder makes of its clips (upstream's formula over the valid frames).

Samples keep only the frames the encoder needs, not the 30 s window (see docs/data.md, "audio"):

* ``input_features [F, n_mels]`` float32: the clips' frames, concatenated along time;
* ``audio_feature_lens [n]``: valid frames per clip (upstream's ``feature_attention_mask`` sum);
* ``audio_frames [n]``: frames kept per clip: the valid ones plus ``context_frames`` of the
  window's padding (Qwen2-Audio's convolutions read 2 frames past the last valid one);
* ``mm_token_type_ids [L]``: 3 on audio placeholder tokens (0 text), for the model's merge.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmms_data._audio import AudioOptions, load_audio_clips
from lmms_data._local_processor import register_local_processor
from lmms_data._registry import register_processor
from lmms_data.processors._chat import (
    check_slots,
    fill_slots,
    load_tokenizer,
    template_messages,
    tokenize_media,
)

__all__ = ["AUDIO_TYPE_ID", "Qwen2AudioDataProcessor", "audio_output_lengths"]

#: ``mm_token_type_ids`` value of audio placeholder tokens (0 text, 1 image, 2 video)
AUDIO_TYPE_ID = 3

# media options build_processor passes to every processor: images/video are not this model's
_VISION_OPTIONS = frozenset(
    ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "video_fps",
     "video_max_frames", "tokens_per_second")
)  # fmt: skip


def audio_output_lengths(feature_lens: np.ndarray) -> np.ndarray:
    """Encoder tokens of clips with ``feature_lens`` valid mel frames: a stride-2 convolution
    then a stride-2 pooling (upstream's ``_get_feat_extract_output_lengths``)."""
    after_conv = (np.asarray(feature_lens) - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def tokens_per_group(tokens: list[int], groups: list[list[Any]]) -> list[int]:
    """Sums of ``tokens`` (one per clip, in order) over consecutive ``groups`` of clips."""
    out, i = [], 0
    for group in groups:
        out.append(sum(tokens[i : i + len(group)]))
        i += len(group)
    return out


def load_feature_extractor(processor: Any) -> Any:
    """The audio feature extractor from a local folder or a loaded HF processor."""
    if isinstance(processor, str):
        from transformers import AutoFeatureExtractor

        return AutoFeatureExtractor.from_pretrained(processor)
    fe = getattr(processor, "feature_extractor", None)
    if fe is None:
        raise ValueError("the processor has no feature_extractor: not an audio model's processor")
    return fe


def audio_options(options: dict[str, Any], default_max: float | None) -> AudioOptions:
    """:class:`AudioOptions` from the processor's ``audio_*`` options (``dataset_config.extra``)."""
    return AudioOptions(
        max_seconds=options.pop("audio_max_seconds", default_max),
        long_audio=options.pop("audio_long", "chunk"),
        max_total_seconds=options.pop("audio_max_total_seconds", 20 * 60.0),
        min_samples=options.pop("audio_min_samples", 400),
    )


class AudioFeatures:
    """Clips -> the model's log-mel features, through its own feature extractor."""

    def __init__(self, feature_extractor: Any, *, context_frames: int) -> None:
        self.fe = feature_extractor
        self.rate = int(feature_extractor.sampling_rate)
        self.window = int(feature_extractor.nb_max_frames)  # frames of the padded window
        self.context_frames = context_frames

    def __call__(self, clips: list[np.ndarray]) -> dict[str, np.ndarray]:
        """``{"input_features" [F, n_mels], "audio_feature_lens" [n], "audio_frames" [n]}``."""
        # Padded to the frames kept, not to the whole window: every kept frame sees the same
        # samples (the window's zeros past the clip; reflection only past what is kept), and the
        # log-mel floor (max - 8) takes its max over the clip's frames either way, so values equal
        # a full-window call (tested against transformers' processor) at a fraction of the STFT.
        hop, longest = int(self.fe.hop_length), max(len(c) for c in clips)
        need = (-(-longest // hop) + self.context_frames + 2) * hop + int(self.fe.n_fft)
        out = self.fe(
            clips, sampling_rate=self.rate, return_attention_mask=True, padding="max_length",
            max_length=min(need, int(self.fe.n_samples)), truncation=True, return_tensors="np",
        )  # fmt: skip
        feats = np.asarray(out["input_features"], dtype=np.float32)  # [n, n_mels, window]
        lens = np.asarray(out["attention_mask"]).sum(-1).astype(np.int64)  # [n]
        keep = np.minimum(lens + self.context_frames, feats.shape[-1])  # [n]
        frames = [f[:, :k].T for f, k in zip(feats, keep.tolist(), strict=True)]  # [k, n_mels]
        return {
            "input_features": np.ascontiguousarray(np.concatenate(frames)),
            "audio_feature_lens": lens,
            "audio_frames": keep.astype(np.int64),
        }


@register_processor("qwen2_audio")
class Qwen2AudioDataProcessor:
    """Chat messages with text and audio parts -> one sample (docs/contracts.md, "sample").

    Options (from ``dataset_config.extra``): ``audio_max_seconds`` (default 30, the encoder's
    window: longer audio is cut into 30 s clips), ``audio_long`` ("chunk", "truncate", "skip"),
    ``audio_max_total_seconds`` (default 1200), ``audio_min_samples`` (default 400).
    """

    media_types: tuple[str, ...] = ("audio",)
    audio_token = "<|AUDIO|>"
    context_frames = 2

    def __init__(self, processor: Any, **options: Any) -> None:
        options = {k: v for k, v in options.items() if k not in _VISION_OPTIONS}
        self.audio = audio_options(options, default_max=30.0)
        if options:
            raise TypeError(f"{type(self).__name__} got unknown option(s) {sorted(options)}")
        self.tokenizer = load_tokenizer(processor)
        self.features = AudioFeatures(
            load_feature_extractor(processor), context_frames=self.context_frames
        )
        window = self.features.window * self.features.fe.hop_length / self.features.rate
        if self.audio.max_seconds is None or self.audio.max_seconds > window:
            raise ValueError(
                f"{type(self).__name__}: audio_max_seconds must be at most the encoder's window "
                f"of {window:g} s (got {self.audio.max_seconds}); longer audio is chunked"
            )
        self.audio_token_id = self.tokenizer.convert_tokens_to_ids(self.audio_token)
        if self.audio_token_id is None or self.audio_token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer lacks {self.audio_token}: not an audio model's tokenizer")

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        clips_per_part: list[list[np.ndarray]] = []
        rate = self.features.rate
        take = {
            "audio": lambda p: clips_per_part.append(load_audio_clips(p["audio"], rate, self.audio))
        }
        template_msgs = template_messages(messages, type(self).__name__, take, name_media=True)
        text = self.tokenizer.apply_chat_template(template_msgs, tokenize=False)
        check_slots(text, {self.audio_token: len(clips_per_part)})
        sample: dict[str, Any] = {}
        if clips_per_part:
            sample.update(self.features([c for clips in clips_per_part for c in clips]))
            tokens = audio_output_lengths(sample["audio_feature_lens"]).tolist()
            per_part = tokens_per_group(tokens, clips_per_part)
            text = fill_slots(text, self.audio_token, [self.audio_token * n for n in per_part])
        ids, labels, types = tokenize_media(
            self.tokenizer, text, {self.audio_token_id: AUDIO_TYPE_ID}
        )
        L = len(ids)
        sample.update(
            input_ids=ids,
            labels=labels,
            position_ids=np.arange(L, dtype=np.int64),
            length=L,
            mm_token_type_ids=types,
            audio_tokens=int((types != 0).sum()),
        )
        return sample


@register_local_processor("qwen2_audio")
def _local_audio(out_dir: str, family: str, *, vocab_size: int = 1024, **_: Any) -> dict:
    from lmms_data.processors._local_audio import build_local_audio_processor

    return build_local_audio_processor(out_dir, family, vocab_size=vocab_size)
