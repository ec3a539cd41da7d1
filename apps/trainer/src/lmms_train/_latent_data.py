"""Data set-up for diffusion transformers (families whose spec says ``latent_batches``).

Instead of packed token rows they read *latent batches* (``lmms_data.build_latent_loader``):
images/clips or precomputed latents, one bucket shape per batch, with per-record noise seeds. The
loader's options sit in ``dataset_config.extra`` (``batch_size``, ``image_buckets``,
``frame_buckets``, ``max_aspect_error``, ``video_fps``, ``text_max_length``); captions are
tokenised with the tokenizer folder ``dataset_config.processor_path`` / ``model_config.
processor_path`` (Wan: its umT5 tokenizer).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from lmms_train._data_setup import TrainData, _exists, _processor_path, data_config
from lmms_train._dist import DistEnv
from lmms_train._errors import ConfigError, UserError
from lmms_train.config import TrainConfig

__all__ = ["build_latent_data", "generate_latent_demo", "model_config_for_data"]


def generate_latent_demo(g: Any, out: str, kind: str) -> None:
    """Synthetic ``shapes`` (image + class label) or ``clips`` (moving shape + caption)."""
    from lmms_data import generate_synthetic_clips, generate_synthetic_shapes

    if kind == "shapes":
        generate_synthetic_shapes(out, g.num_samples, seed=g.seed, image_size=g.image_size)
    else:
        generate_synthetic_clips(out, g.num_samples, seed=g.seed, size=g.image_size)


def model_config_for_data(cfg: TrainConfig, spec: Any) -> dict[str, Any]:
    """The model's config dict (transformer keys plus frozen encoders), as built."""
    from lmms_train._model_setup import model_config_dict

    m = cfg.model_config
    if m.load_from_config is not None:
        return model_config_dict(cfg, spec, None)
    return spec.pretrained_config(m.load_from_pretrained_path)


def _tokenizer(cfg: TrainConfig) -> Any:
    path = _processor_path(cfg)
    if not path or not Path(path).exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load the tokenizer from {path!r}: {exc}") from exc


def build_latent_data(cfg: TrainConfig, env: DistEnv, spec: Any) -> tuple[TrainData, Any]:
    """This rank's latent-batch stream (resumable) and a callable giving validation batches."""
    from lmms_data import build_latent_loader

    d, t = cfg.dataset_config, cfg.trainer_args
    if not _exists(d.dataset_path):
        raise UserError(f"dataset_config.dataset_path: {d.dataset_path!r} does not exist")
    model_conf = model_config_for_data(cfg, spec)
    tokens_fn = spec.tokens_fn(model_conf)
    num_classes = spec.num_classes(model_conf)  # labels out of range are bad records
    tokenizer = _tokenizer(cfg)

    def loader(dcfg: Any) -> Any:
        try:
            return build_latent_loader(dcfg, dp_rank=env.dp_rank, dp_world=env.dp_size,
                                       tokens_fn=tokens_fn, tokenizer=tokenizer,
                                       num_classes=num_classes)  # fmt: skip
        except ValueError as exc:
            raise ConfigError(f"dataset_config: {exc}") from exc

    train = loader(data_config(cfg, spec))
    eval_data = None
    if d.eval_dataset_path is not None and t.eval_steps > 0:
        ecfg = data_config(cfg, spec, dataset_path=d.eval_dataset_path, shuffle=False)

        def eval_data() -> list[dict[str, Any]]:
            return list(itertools.islice(iter(TrainData(loader(ecfg))), t.eval_batches))

    return TrainData(train), eval_data


def read_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
