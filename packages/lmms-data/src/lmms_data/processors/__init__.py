"""Per-family processors (chat record -> sample); registered by name in ``PROCESSOR_REGISTRY``."""

from lmms_data.processors._audio import (
    AUDIO_TYPE_ID,
    Qwen2AudioDataProcessor,
    audio_output_lengths,
)
from lmms_data.processors._bagel import BagelDataProcessor, collate_parts
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

__all__ = [
    "AUDIO_TYPE_ID",
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
    "mrope_positions",
    "smart_resize",
    "tmrope_positions",
    "tokenize_chat",
]
