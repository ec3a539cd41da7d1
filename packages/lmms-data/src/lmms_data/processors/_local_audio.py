"""Local processor folders of the audio families (``build_local_processor(path, "qwen2_audio")``;
registered by their processor modules).

The tokenizer is the tiny deterministic one of :mod:`lmms_data._local_processor` with the audio
special tokens of the Qwen audio models appended (``<|AUDIO|>``, ``<|audio_bos|>``,
``<|audio_eos|>``), a chat template that renders an audio part the way the released Qwen2-Audio
template does (``Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>``), and the model's own feature
extractor: Whisper log-mel with the released settings (128 mel bins, 16 kHz, 10 ms hop, 25 ms
window, 30 s window). The folder loads with ``AutoTokenizer`` / ``AutoFeatureExtractor`` and,
for ``qwen2_audio``, with transformers' ``Qwen2AudioProcessor`` (the parity tests use it);
``qwen2_5_omni`` adds the Qwen-VL image processor (``AutoImageProcessor``) and a template that
renders images and videos as the Qwen-VL folders do and audio with the markers above.
"""

from __future__ import annotations

import json
import os
from typing import Any

from lmms_data._local_processor import VISION_PARTS, chat_template

__all__ = ["AUDIO_FAMILIES", "AUDIO_SPECIAL_TOKENS", "build_local_audio_processor"]

AUDIO_FAMILIES = ("qwen2_audio", "qwen2_5_omni", "qwen3_omni_moe")
AUDIO_SPECIAL_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")

AUDIO_CHAT_TEMPLATE = chat_template(
    "{% if content['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n",
    prelude="{% set audio_count = namespace(value=0) %}",
)

#: Qwen2.5-Omni: images and videos as in the Qwen-VL folders, audio as Qwen2-Audio's markers
OMNI_CHAT_TEMPLATE = chat_template(
    VISION_PARTS + "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
)


def whisper_feature_extractor(**overrides: Any) -> Any:
    """transformers' ``WhisperFeatureExtractor`` with the Qwen audio models' settings."""
    from transformers import WhisperFeatureExtractor

    kwargs: dict[str, Any] = dict(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400,
        padding_value=0.0, return_attention_mask=True,
    )  # fmt: skip
    kwargs.update(overrides)
    return WhisperFeatureExtractor(**kwargs)


def build_local_audio_processor(
    out_dir: str, family: str = "qwen2_audio", *, vocab_size: int = 1024
) -> dict[str, Any]:
    """Write the tokenizer, chat template and feature extractor of ``family`` to ``out_dir``.

    Returns the info dict of :func:`lmms_data.build_local_processor` plus ``audio_token_id``,
    ``audio_bos_token_id``, ``audio_eos_token_id`` and ``sampling_rate``.
    """
    from lmms_data._local_processor import SPECIAL_TOKENS, _write_info, train_tokenizer

    if family not in AUDIO_FAMILIES:
        raise ValueError(f"unknown audio family {family!r}; known: {list(AUDIO_FAMILIES)}")
    os.makedirs(out_dir, exist_ok=True)
    omni = family in ("qwen2_5_omni", "qwen3_omni_moe")
    omni3 = family == "qwen3_omni_moe"  # Qwen3-VL's vision: 16-pixel patches
    template = OMNI_CHAT_TEMPLATE if omni else AUDIO_CHAT_TEMPLATE
    hf_tok = train_tokenizer(
        vocab_size, (*SPECIAL_TOKENS, *AUDIO_SPECIAL_TOKENS), chat_template=template
    )
    fe = whisper_feature_extractor()
    if omni:  # the Qwen-VL image/video processors, then the feature extractor beside them
        from lmms_data.processors._qwen_vl import LOCAL_VL, save_vl

        if omni3:
            save_vl(out_dir, LOCAL_VL["qwen3_vl"], hf_tok, 64 * 64, 32 * 32 * 256)
        else:
            save_vl(out_dir, LOCAL_VL["qwen2_5_vl"], hf_tok, 56 * 56, 28 * 28 * 256)
        hf_tok.chat_template = template
        hf_tok.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
            f.write(template)
        fe.save_pretrained(out_dir)
    try:
        if omni:
            raise ImportError  # saved above
        from transformers import Qwen2AudioProcessor

        proc = Qwen2AudioProcessor(
            feature_extractor=fe, tokenizer=hf_tok, chat_template=AUDIO_CHAT_TEMPLATE
        )
        proc.save_pretrained(out_dir)
    except (ImportError, AttributeError, TypeError, ValueError):
        if not omni:
            hf_tok.save_pretrained(out_dir)
            fe.save_pretrained(out_dir)
    info = _write_info(out_dir, family, hf_tok, patch=(16 if omni3 else 14) if omni else None)
    tid = hf_tok.convert_tokens_to_ids
    info.update(
        audio_token_id=tid("<|AUDIO|>"),
        audio_bos_token_id=tid("<|audio_bos|>"),
        audio_eos_token_id=tid("<|audio_eos|>"),
        sampling_rate=fe.sampling_rate,
    )
    info["special_token_ids"].update({t: tid(t) for t in AUDIO_SPECIAL_TOKENS})
    with open(os.path.join(out_dir, "lmms_processor_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info
