"""Data set-up: demo inputs generated on first use, then the family's data plan.

`prepare_inputs` makes a fresh clone self-contained: when the config says how
(`dataset_config.generate_synthetic`, `model_config.build_local_processor`) and the paths do not
exist, rank 0 generates the synthetic dataset and a small local tokenizer/processor folder
(deterministic, seconds), and every rank waits for it.

`build_data` and `lmms-train check-data` go through one interface: `data_source(cfg, spec, env)`
is the trainer's implementation (`_data_source.DataSource`) of the plan the family's spec
declares (`ModelSpec.data_plan`), looked up by the plan's class (`DATA_SOURCES`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmms_models import DataPlan, LatentBatches, ModelPackedRows, TokenRows
from lmms_train._data_source import (
    DataSource,
    TrainData,
    data_config,
    path_exists,
    processor_path,
)
from lmms_train._dist import DistEnv
from lmms_train._errors import ConfigError
from lmms_train._latent_data import LatentSource, model_config_for_data
from lmms_train._token_data import ModelPackedSource, TokenSource
from lmms_train.config import TrainConfig

__all__ = [
    "DATA_SOURCES",
    "TrainData",
    "build_data",
    "data_config",
    "data_source",
    "prepare_inputs",
]

#: The trainer's implementation of each data plan a family may declare.
DATA_SOURCES: dict[type[DataPlan], type[DataSource]] = {
    TokenRows: TokenSource,
    ModelPackedRows: ModelPackedSource,
    LatentBatches: LatentSource,
}
_processor_path = processor_path  # the name other modules of the trainer import

_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "audio_token_id": "<|AUDIO|>",
    "audio_start_token_id": "<|audio_bos|>",
    "audio_end_token_id": "<|audio_eos|>",
}


def data_source(cfg: TrainConfig, spec: Any, env: DistEnv) -> DataSource:
    """The implementation of the plan `spec` declares for this run's model config."""
    try:
        plan = spec.data_plan(lambda: model_config_for_data(cfg, spec))
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the model config's values, e.g. a patch size
        raise ConfigError(f"model_config: {exc}") from None
    try:
        source = DATA_SOURCES[type(plan)]
    except KeyError:
        known = ", ".join(c.__name__ for c in DATA_SOURCES)
        raise TypeError(
            f"{spec.name}.data_plan returned a {type(plan).__name__}; the trainer implements "
            f"{known}"
        ) from None
    return source(cfg, spec, plan, env)


def build_data(cfg: TrainConfig, env: DistEnv, spec: Any) -> tuple[TrainData, Any]:
    """This rank's training stream and a callable giving the validation rows (or None)."""
    source = data_source(cfg, spec, env)
    return source.train(), source.eval_rows()


def prepare_inputs(cfg: TrainConfig, env: DistEnv, spec: Any) -> dict[str, int] | None:
    """Generate missing demo data / processor (rank 0); return the processor's token ids when
    it was built locally (so a model built from config gets a matching vocabulary)."""
    d, m = cfg.dataset_config, cfg.model_config
    proc = processor_path(cfg)
    family = d.processor_family or spec.processor_family
    if env.is_main:
        if (
            d.generate_synthetic is not None
            and isinstance(d.dataset_path, str)
            and not path_exists(d.dataset_path)
        ):
            _generate(d.generate_synthetic, d.dataset_path, spec)
        if m.build_local_processor and proc and not Path(proc).exists():
            from lmms_data import build_local_processor

            try:
                build_local_processor(proc, family)
            except ValueError as exc:
                raise ConfigError(f"model_config.build_local_processor: {exc}") from exc
    env.barrier()
    if not (m.build_local_processor and proc):
        return None
    return _token_ids(proc, vision=bool(spec.media_keys))


def _generate(g: Any, dataset_path: str, spec: Any) -> None:
    """Synthetic records of `g.kind` (default: the family's `synthetic_kind`, else `omni`, `audio`,
    `vl` or `text` by the media the family takes)."""
    from lmms_data import generate_synthetic

    out = dataset_path if not Path(dataset_path).suffix else str(Path(dataset_path).parent)
    kind = g.kind or spec.synthetic_kind
    audio, vision = "input_features" in spec.media_keys, "pixel_values" in spec.media_keys
    default = "omni" if audio and vision else "audio" if audio else "vl" if vision else "text"
    generate_synthetic(kind or default, out, g.num_samples, format=g.format, seed=g.seed,
                       image_size=g.image_size)  # fmt: skip
    return None


def _token_ids(path: str, *, vision: bool = True) -> dict[str, int]:
    """Vocabulary size and special-token ids of a local tokenizer (vision tokens only for models
    that take media: a text model's config has no use for them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = {"vocab_size": len(tok)}
    for key, token in _TOKENS.items() if vision else ():
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids[key] = tid
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(tok, key, None) is not None:
            ids[key] = getattr(tok, key)
    return ids
