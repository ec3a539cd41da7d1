"""lmms-data: streaming multimodal datasets, processors and packed batches that resume exactly.

Public API::

    DatasetConfig(...) / DatasetConfig.from_dict(yaml_section)     # unknown keys rejected
    build_dataloader(config, processor, dp_rank, dp_world, num_workers, seed) -> PackedLoader
        iter() -> packed batches; .state_dict() / .load_state_dict(); .metrics()
    build_processor(family, hf_processor_or_path, config) ; PROCESSOR_REGISTRY
    @register_dataset("name") (record adapter) ; @register_processor("family") ; check_keys(...)
    collate_packed_batch(samples) -> dict of torch tensors
    build_local_processor(out_dir, family, vocab_size) -> info dict (token ids)
    generate_synthetic_vl(out_dir, n, format="parquet" | "jsonl", seed=0)
    generate_synthetic_text(out_dir, n, format="parquet" | "jsonl", seed=0)   # text-only records
    generate_synthetic_audio(out_dir, n, format="parquet" | "jsonl", seed=0)  # tone "digits"
    generate_synthetic_omni(out_dir, n, ...)   # half image records, half audio records
    generate_synthetic(kind, out_dir, n, ...)  # any kind of SYNTHETIC_KINDS (families add theirs)
    decode_audio(src, sampling_rate) ; AudioOptions(...)   # the audio path (extra `audio`)
    resolve_hub_path("org/name[@rev]", kind="model" | "processor" | "dataset") -> local folder
"""

from lmms_data import _datasets as _datasets  # registers the built-in dataset types
from lmms_data import _preference as _preference  # registers `preference` (DPO pairs)
from lmms_data import processors as processors  # registers the built-in processors
from lmms_data._audio import AudioOptions, decode_audio, load_audio_clips
from lmms_data._collate import MEDIA_KEYS, collate_packed_batch
from lmms_data._config import DatasetConfig
from lmms_data._errors import BAD_REASONS, BadRecordError, BadRecordRatioExceeded, BadRecordStats
from lmms_data._hub import HubError, hub_cache_dir, is_hub_id, resolve_hub_path, split_hub_id
from lmms_data._latent import LatentLoader, build_latent_loader
from lmms_data._loader import (
    DatasetChangedError,
    PackedLoader,
    build_dataloader,
    build_dataset,
    build_processor,
    dataset_fingerprint,
)
from lmms_data._local_processor import SPECIAL_TOKENS, build_local_processor
from lmms_data._readers import Unit, discover_units, iter_unit
from lmms_data._records import normalise
from lmms_data._registry import (
    DATASET_REGISTRY,
    PROCESSOR_REGISTRY,
    Registry,
    check_keys,
    register_dataset,
    register_processor,
)
from lmms_data._remote import dataset_path_exists
from lmms_data._stream import SlotStream
from lmms_data._synthetic import generate_synthetic_text, generate_synthetic_vl
from lmms_data._synthetic_audio import generate_synthetic_audio, generate_synthetic_omni
from lmms_data._synthetic_diffusion import generate_synthetic_clips, generate_synthetic_shapes
from lmms_data._synthetic_kinds import SYNTHETIC_KINDS, generate_synthetic, register_synthetic_kind
from lmms_data._synthetic_preference import generate_synthetic_preference
from lmms_data.processors import (
    AUDIO_TYPE_ID,
    IGNORE_INDEX,
    TEXT_FAMILIES,
    Qwen2AudioDataProcessor,
    QwenTextProcessor,
    QwenVLProcessor,
    mrope_positions,
)

__version__ = "0.1.0"

__all__ = [
    "AUDIO_TYPE_ID",
    "BAD_REASONS",
    "DATASET_REGISTRY",
    "IGNORE_INDEX",
    "MEDIA_KEYS",
    "PROCESSOR_REGISTRY",
    "SPECIAL_TOKENS",
    "SYNTHETIC_KINDS",
    "TEXT_FAMILIES",
    "AudioOptions",
    "BadRecordError",
    "BadRecordRatioExceeded",
    "BadRecordStats",
    "DatasetChangedError",
    "DatasetConfig",
    "HubError",
    "LatentLoader",
    "PackedLoader",
    "Qwen2AudioDataProcessor",
    "QwenTextProcessor",
    "QwenVLProcessor",
    "Registry",
    "SlotStream",
    "Unit",
    "__version__",
    "build_dataloader",
    "build_dataset",
    "build_latent_loader",
    "build_local_processor",
    "build_processor",
    "check_keys",
    "collate_packed_batch",
    "dataset_fingerprint",
    "dataset_path_exists",
    "decode_audio",
    "discover_units",
    "generate_synthetic",
    "generate_synthetic_audio",
    "generate_synthetic_clips",
    "generate_synthetic_omni",
    "generate_synthetic_preference",
    "generate_synthetic_shapes",
    "generate_synthetic_text",
    "generate_synthetic_vl",
    "hub_cache_dir",
    "is_hub_id",
    "iter_unit",
    "load_audio_clips",
    "mrope_positions",
    "normalise",
    "processors",
    "register_dataset",
    "register_processor",
    "register_synthetic_kind",
    "resolve_hub_path",
    "split_hub_id",
]
