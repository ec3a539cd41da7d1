"""``DatasetConfig``: the ``dataset_config`` section of the trainer YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lmms_data._registry import check_keys
from lmms_data.processors import DEFAULT_PROCESSOR_FAMILY

BAD_RECORD_POLICIES = ("skip", "raise")
FORMATS = ("jsonl", "json", "json_array", "parquet", "arrow", "hf")


@dataclass(kw_only=True, slots=True)
class DatasetConfig:
    """Where the records are, how they become samples and how samples are packed.

    ``dataset_path`` is a file, a directory or glob of shards, or a list of those (a mixture, with
    ``mixture_weights``). The format is detected from the extension (``.jsonl``, ``.jsonl.gz``,
    ``.json``, ``.parquet``, ``.arrow``, ``.feather``, ``.ipc``; a directory saved by
    ``datasets.Dataset.save_to_disk`` is ``hf``) unless ``dataset_format`` is given.
    """

    dataset_type: str = "chat"  # record adapter from the dataset registry
    dataset_path: str | list[str] = ""
    dataset_format: str | None = None  # one of FORMATS; None = from the extension (.json sniffed)
    data_folder: str | None = None  # base of relative media paths (default: the shard's folder)
    allow_absolute_paths: bool = False  # media paths may be absolute / escape data_folder
    mixture_weights: list[float] | None = None  # one per dataset_path entry
    processor_family: str = DEFAULT_PROCESSOR_FAMILY
    processor_path: str | None = None  # local HF-format folder (AutoProcessor.from_pretrained)
    packing: bool = True
    packing_strategy: str = "first_fit"
    packing_length: int = 4096
    max_open_bins: int = 8
    # at most this many vision tokens per pack (a second packing budget): vision work per pack,
    # and so per data-parallel rank, stays bounded; None = no limit
    max_vision_tokens_per_pack: int | None = None
    # look-ahead packs per DP rank for vision-FLOPs balancing across DP ranks (lmms_data._balance;
    # no communication); 0 = packs in produced order
    vision_balance_window: int = 0
    bad_record_policy: str = "skip"
    max_bad_record_ratio: float = 0.1  # abort when bad/seen exceeds this ...
    min_records_for_ratio: int = 200  # ... once at least this many records were seen
    shuffle: bool = True
    shuffle_buffer: int = 256  # records held for local shuffling (0 = no buffer)
    seed: int = 0
    num_workers: int = 2
    num_epochs: int | None = None  # None = infinite (for max_steps-driven training)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_fps: float = 2.0
    video_max_frames: int = 32
    prefetch_factor: int = 2
    extra: dict[str, Any] = field(default_factory=dict)  # processor options, e.g. tokens_per_second

    def __post_init__(self) -> None:
        if self.bad_record_policy not in BAD_RECORD_POLICIES:
            raise ValueError(
                f"bad_record_policy must be one of {BAD_RECORD_POLICIES}, got {self.bad_record_policy!r}"
            )
        if self.dataset_format is not None and self.dataset_format not in FORMATS:
            raise ValueError(
                f"dataset_format must be one of {FORMATS}, got {self.dataset_format!r}"
            )
        if self.packing_length <= 0 or self.max_open_bins <= 0:
            raise ValueError("packing_length and max_open_bins must be positive")
        if self.max_vision_tokens_per_pack is not None and self.max_vision_tokens_per_pack <= 0:
            raise ValueError("max_vision_tokens_per_pack must be positive (or unset)")
        if self.vision_balance_window < 0 or self.vision_balance_window == 1:
            raise ValueError("vision_balance_window must be 0 (off) or at least 2")
        if self.mixture_weights is not None:
            n = len(self.paths)
            if len(self.mixture_weights) != n or any(w < 0 for w in self.mixture_weights):
                raise ValueError(
                    f"mixture_weights needs {n} non-negative weights (one per dataset_path), "
                    f"got {self.mixture_weights}"
                )
            if sum(self.mixture_weights) <= 0:
                raise ValueError("mixture_weights must not all be zero")

    @property
    def paths(self) -> list[str]:
        return (
            [self.dataset_path] if isinstance(self.dataset_path, str) else list(self.dataset_path)
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetConfig:
        """Build from a YAML mapping; unknown keys raise with a suggestion."""
        check_keys(d, [f.name for f in dataclasses.fields(cls)], "dataset_config")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
