"""Latent batches: the data plan `lmms_models.LatentBatches` (diffusion transformers).

Instead of packed token rows they read *latent batches* (``lmms_data.build_latent_loader``):
images/clips or precomputed latents, one bucket shape per batch, with per-record noise seeds. The
loader's options sit in ``dataset_config.extra`` (``batch_size``, ``image_buckets``,
``frame_buckets``, ``max_aspect_error``, ``video_fps``, ``text_max_length``); captions are
tokenised with the tokenizer folder ``dataset_config.processor_path`` / ``model_config.
processor_path`` (Wan: its umT5 tokenizer). The plan gives ``tokens_fn`` (transformer tokens of a
sample: FLOPs, throughput) and ``num_classes`` (labels out of range are bad records).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from lmms_train._data_report import DataReport
from lmms_train._data_source import DataSource, processor_path
from lmms_train._errors import ConfigError, UserError
from lmms_train.config import TrainConfig

__all__ = ["LatentSource", "model_config_for_data", "tokenizer_for_data"]


def model_config_for_data(cfg: TrainConfig, spec: Any) -> dict[str, Any]:
    """The model's config dict (transformer keys plus frozen encoders), as built."""
    from lmms_train._model_setup import model_config_dict

    m = cfg.model_config
    if m.load_from_config is not None:
        return model_config_dict(cfg, spec, None)
    return spec.pretrained_config(m.load_from_pretrained_path)


def tokenizer_for_data(cfg: TrainConfig) -> Any:
    """The captions' tokenizer (the run's processor folder), or None where there is none."""
    path = processor_path(cfg)
    if not path or not Path(path).exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load the tokenizer from {path!r}: {exc}") from exc


class LatentSource(DataSource):
    """`LatentBatches`: this rank's resumable latent loader (validation: the same, unshuffled)."""

    def __init__(self, cfg: Any, spec: Any, plan: Any, env: Any) -> None:
        super().__init__(cfg, spec, plan, env)
        self.tokenizer = tokenizer_for_data(cfg)

    def loader(self, dcfg: Any, *, limit: int | None = None) -> Any:
        """The loader of `dcfg` (`limit`: read at most that many records, for check-data)."""
        from lmms_data import LatentLoader

        cls = LatentLoader if limit is None else _head(LatentLoader, limit)
        try:
            return cls(dcfg, dp_rank=self.env.dp_rank, dp_world=self.env.dp_size,
                       tokens_fn=self.plan.tokens_fn, tokenizer=self.tokenizer,
                       num_classes=self.plan.num_classes)  # fmt: skip
        except ValueError as exc:
            raise ConfigError(f"dataset_config: {exc}") from exc

    def check(self, num_records: int) -> DataReport:
        """Read the first `num_records` records (no shuffle, one per batch) into their buckets."""
        dcfg = self.dataset_config()
        self.check_inputs(dcfg)
        batch_size = int(dcfg.extra.get("batch_size", 8))
        one = dataclasses.replace(dcfg, shuffle=False, num_epochs=1, bad_record_policy="skip",
                                  max_bad_record_ratio=1.0, extra={**dcfg.extra, "batch_size": 1})  # fmt: skip
        loader = self.loader(one, limit=num_records)
        what = f"latent batches; tokenizer {processor_path(self.cfg)}" if self.tokenizer else ""
        report = DataReport(paths=list(dcfg.paths), processor=what or "latent batches",
                            packing=False, batch_size=batch_size, total_records=len(loader.records),
                            accum=self.cfg.trainer_args.gradient_accumulation_steps)  # fmt: skip
        t0 = time.perf_counter()
        for batch in loader:
            self._count(batch, report)
        report.seconds = time.perf_counter() - t0
        report.seen = loader.stats.seen
        report.bad = dict(loader.stats.bad)
        for ex in loader.stats.examples:
            reason, _, rest = ex.partition(": ")
            report.examples.setdefault(reason, rest)
        return report

    def _count(self, batch: dict[str, Any], report: DataReport) -> None:
        """One record (a batch of one): its transformer tokens (all trained), bucket and media."""
        key = "latents" if "latents" in batch else "pixel_values"
        shape = tuple(batch[key].shape[1:])
        tokens = int(batch["max_seqlen"])
        report.lengths.append(tokens)
        report.supervised.append(tokens)
        report.media_tokens.append(tokens)
        report.shapes[f"{key} {'x'.join(map(str, shape))}"] += 1
        if key == "pixel_values":
            report.media["video" if len(shape) == 4 else "image"] += 1
        if report.sample:
            return
        what = [f"{key} {list(shape)}"]
        if "class_labels" in batch:
            what.append(f"class {int(batch['class_labels'][0])}")
        if "input_ids" in batch and self.tokenizer is not None:
            ids = batch["input_ids"][0][batch["attention_mask"][0].bool()]
            what.append(f"caption [[{self.tokenizer.decode(ids.tolist())}]]")
        if "text_embeds" in batch:
            what.append(f"text_embeds {list(batch['text_embeds'].shape[1:])}")
        report.sample = ", ".join(what)


def _head(base: type, limit: int) -> type:
    """`LatentLoader` reading at most `limit` records (good or bad)."""

    class Head(base):
        def _next_index(self) -> int | None:
            return None if self.stats.seen >= limit else super()._next_index()

    return Head
