"""One folder per model family; importing this package registers them all."""

from . import (  # noqa: F401
    aero,
    bagel,
    fla_gated_deltanet,
    llama,
    llava_onevision,
    qwen2,
    qwen2_5,
    qwen2_5_omni,
    qwen2_5_vl,
    qwen2_audio,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_omni_moe,
    qwen3_vl,
    qwen3_vl_moe,
    sit,
    wan,
)
