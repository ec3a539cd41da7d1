"""Per-family processors (chat record -> sample); registered by name in ``PROCESSOR_REGISTRY``."""

from lmms_data.processors._mrope import mrope_positions
from lmms_data.processors._qwen_vl import (
    IGNORE_INDEX,
    Qwen2_5_VLDataProcessor,
    Qwen3VLDataProcessor,
    QwenVLProcessor,
    smart_resize,
)

__all__ = [
    "IGNORE_INDEX",
    "Qwen2_5_VLDataProcessor",
    "Qwen3VLDataProcessor",
    "QwenVLProcessor",
    "mrope_positions",
    "smart_resize",
]
