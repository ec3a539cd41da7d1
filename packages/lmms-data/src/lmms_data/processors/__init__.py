"""Per-family processors (chat record -> sample); registered by name in ``PROCESSOR_REGISTRY``.
A family's own demo records register here too (``SYNTHETIC_KINDS``)."""

from lmms_data.processors._audio import (
    AUDIO_TYPE_ID,
    Qwen2AudioDataProcessor,
    audio_output_lengths,
)
from lmms_data.processors._bagel import BagelDataProcessor, collate_parts
from lmms_data.processors._bagel_synthetic import generate_synthetic_bagel
from lmms_data.processors._chat import IGNORE_INDEX, tokenize_chat
from lmms_data.processors._llava_onevision import LlavaOnevisionDataProcessor, anyres_image_tokens
from lmms_data.processors._mrope import mrope_positions
from lmms_data.processors._omni import Qwen2_5OmniDataProcessor, tmrope_positions
from lmms_data.processors._omni3 import Qwen3OmniMoeDataProcessor
from lmms_data.processors._pretrain import PretrainTextProcessor
from lmms_data.processors._qwen_vl import (
    Qwen2_5_VLDataProcessor,
    Qwen3VLDataProcessor,
    QwenVLProcessor,
    smart_resize,
)
from lmms_data.processors._text import TEXT_FAMILIES, QwenTextProcessor

#: The processor of a ``DatasetConfig`` that names none (the quickstart's vision-language family).
DEFAULT_PROCESSOR_FAMILY = "qwen2_5_vl"

__all__ = [
    "AUDIO_TYPE_ID",
    "DEFAULT_PROCESSOR_FAMILY",
    "IGNORE_INDEX",
    "TEXT_FAMILIES",
    "BagelDataProcessor",
    "LlavaOnevisionDataProcessor",
    "PretrainTextProcessor",
    "Qwen2AudioDataProcessor",
    "Qwen2_5OmniDataProcessor",
    "Qwen2_5_VLDataProcessor",
    "Qwen3OmniMoeDataProcessor",
    "Qwen3VLDataProcessor",
    "QwenTextProcessor",
    "QwenVLProcessor",
    "anyres_image_tokens",
    "audio_output_lengths",
    "collate_parts",
    "generate_synthetic_bagel",
    "mrope_positions",
    "smart_resize",
    "tmrope_positions",
    "tokenize_chat",
]
