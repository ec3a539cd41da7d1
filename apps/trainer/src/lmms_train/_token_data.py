"""Token rows: the data plans `lmms_models.TokenRows` (the default) and `ModelPackedRows`.

Records -> lmms_data's processor of the family (`processor_family`, options from the plan under
the user's `dataset_config.extra`) -> samples of text/media tokens -> lmms_pack's packed rows
(`lmms_data.build_dataloader`). `ModelPackedRows` adds the family's own last packing step on the
host (`plan.finish`; on CUDA every row padded to `packing_length`, so compiled attention sees
one shape).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from lmms_train._data_report import MEDIA, DataReport, render_sample
from lmms_train._data_source import DataSource, path_exists
from lmms_train._errors import ConfigError, UserError, suggest

__all__ = ["ModelPackedSource", "TokenSource"]


def _is_data_error(exc: Exception) -> bool:
    """An lmms_data start-up error about the user's files (not a bug): a record/file shape it
    cannot read (DataShapeError), an unreadable file under `bad_record_policy: raise`
    (BadRecordError), a missing, empty or unrecognised file, or too few records for the slots."""
    if isinstance(exc, FileNotFoundError):
        return True
    if type(exc).__name__ in ("DataShapeError", "BadRecordError"):
        return True
    text = str(exc)
    return any(k in text for k in ("holds no records", "cannot detect the format", "got no data"))


class TokenSource(DataSource):
    """`TokenRows`: the processor's samples packed by lmms_pack (one processor for the train and
    the validation loaders)."""

    _processor: Any = None
    balances_vision = True  # lmms-data's PackedLoader: `vision_balance_window`

    def dataset_config(self, **overrides: Any) -> Any:
        dcfg = super().dataset_config(**overrides)
        options = self.plan.processor_options
        return dataclasses.replace(dcfg, extra={**options, **dcfg.extra}) if options else dcfg

    def check_inputs(self, dcfg: Any) -> None:
        from lmms_data import PROCESSOR_REGISTRY

        d = self.cfg.dataset_config
        super().check_inputs(dcfg)
        if d.eval_dataset_path is not None and not path_exists(d.eval_dataset_path):
            raise UserError(
                f"dataset_config.eval_dataset_path: {d.eval_dataset_path!r} does not exist"
            )
        names = list(PROCESSOR_REGISTRY.names())
        if dcfg.processor_family not in names:
            raise ConfigError(
                f"no lmms_data processor {dcfg.processor_family!r} for model {self.spec.name!r}"
                f"{suggest(dcfg.processor_family, names)}; registered processors: "
                f"{', '.join(names)}"
            )
        if not dcfg.processor_path or not Path(dcfg.processor_path).exists():
            raise UserError(
                f"tokenizer/processor folder {dcfg.processor_path!r} does not exist (set "
                "model_config.processor_path, or build_local_processor: true for a demo tokenizer)"
            )

    def processor(self, dcfg: Any) -> Any:
        if self._processor is None:
            from lmms_data import build_processor

            try:
                self._processor = build_processor(dcfg.processor_family, dcfg.processor_path, dcfg)
            except (OSError, ValueError) as exc:
                raise UserError(
                    f"could not load the processor from {dcfg.processor_path!r}: {exc}"
                ) from exc
        return self._processor

    def loader(self, dcfg: Any) -> Any:
        from lmms_data import build_dataloader

        processor, env = self.processor(dcfg), self.env
        try:
            return build_dataloader(dcfg, processor, dp_rank=env.dp_rank, dp_world=env.dp_size)
        except (ValueError, FileNotFoundError) as exc:  # what the files hold, found at discovery
            if not _is_data_error(exc):
                raise
            hint = (
                " (dataset_config.bad_record_policy: raise; with `skip` the file is counted as a "
                "bad record and the rest is read)"
                if type(exc).__name__ == "BadRecordError"
                else ""
            )
            raise UserError(f"dataset_config.dataset_path: {exc}{hint}") from None

    # ---------------------------------------------------------------- check-data
    def measured(self, row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
        """`(input_ids, labels marking the supervised tokens, other supervised units)` of one
        processed sample (a row of one)."""
        ids = np.asarray(row["input_ids"]).reshape(-1)
        return ids, np.asarray(row["labels"]).reshape(-1), 0

    def check(self, num_records: int) -> DataReport:
        """Process the first `num_records` records (one process, no workers, no shuffle, each
        sample alone) through the run's readers, record adapter, media and processor."""
        from lmms_data import SlotStream
        from lmms_data._loader import discover

        dcfg = self.dataset_config()
        self.check_inputs(dcfg)
        dcfg = dataclasses.replace(dcfg, num_workers=0, shuffle=False, num_epochs=1,
                                   bad_record_policy="skip", max_bad_record_ratio=1.0)  # fmt: skip
        try:
            processor = self.processor(dcfg)
            units = discover(dcfg, 1)
        except (OSError, ValueError) as exc:
            raise UserError(f"check-data: {exc}") from None
        rec = _Recorder(processor)
        nopack = dataclasses.replace(dcfg, packing=False)  # one sample per batch: each alone
        stream = _head(SlotStream)(nopack, units, rec, slot=0, n_slots=1, as_torch=False)
        stream.limit = num_records
        report = DataReport(paths=dcfg.paths, processor=f"{dcfg.processor_family} from "
                            f"{dcfg.processor_path}", packing_length=dcfg.packing_length,
                            packing=dcfg.packing,
                            accum=self.cfg.trainer_args.gradient_accumulation_steps)  # fmt: skip
        if all(u.fmt in ("parquet", "arrow_file", "arrow_stream") for src in units for u in src):
            report.total_records = sum(u.hi - u.lo for src in units for u in src)
        t0 = time.perf_counter()
        self._measure(stream, rec, processor, report, dcfg)
        report.seconds = time.perf_counter() - t0
        report.seen = stream.stats.seen
        for reason, n in stream.stats.bad.items():
            report.bad[reason] = report.bad.get(reason, 0) + n
        for ex in stream.stats.examples:
            reason, _, rest = ex.partition(": ")
            report.examples.setdefault(reason, rest)
        return report

    def _measure(
        self, stream: Any, rec: Any, processor: Any, report: DataReport, dcfg: Any
    ) -> None:
        media_ids = {
            getattr(processor, a, None)
            for a in ("image_token_id", "video_token_id", "audio_token_id")
        }
        media_ids.discard(None)
        for batch in stream:
            ids, labels, extra = self.measured(batch)
            if dcfg.packing and ids.size > dcfg.packing_length:
                report.bad["too_long"] = report.bad.get("too_long", 0) + 1
                report.examples.setdefault(
                    "too_long", f"{ids.size} tokens > packing_length {dcfg.packing_length}"
                )
                continue
            report.lengths.append(int(ids.size))
            report.supervised.append(int((labels != -100).sum()) + extra)
            report.media.update(rec.last)
            report.media_tokens.append(int(np.isin(ids, list(media_ids)).sum()) if media_ids else 0)
            if not report.sample:
                report.sample = render_sample(processor.tokenizer, ids, labels)


class ModelPackedSource(TokenSource):
    """`ModelPackedRows`: token rows the family finishes packing on the host (`plan.finish`)."""

    def __init__(self, cfg: Any, spec: Any, plan: Any, env: Any) -> None:
        super().__init__(cfg, spec, plan, env)
        d = cfg.dataset_config
        pad_to = d.packing_length if env.device.type == "cuda" and d.packing else None
        self.finish = functools.partial(plan.finish, pad_to=pad_to)

    def measured(self, row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
        """The finished row's tokens; its labels are next-token targets (marked back on the
        target tokens themselves), plus its noised latent tokens (flow matching's units)."""
        row = self.finish(row)
        ids = np.asarray(row["input_ids"]).reshape(-1)
        labels = np.asarray(row["labels"]).reshape(-1)
        return ids, np.concatenate([[-100], labels[:-1]]), int(row.get("num_fm_tokens", 0))


def _head(base: type) -> type:
    """`SlotStream` reading at most `limit` records (good or bad)."""

    class Head(base):
        limit = 0

        def _records(self):
            for k, item in enumerate(super()._records()):
                if k >= self.limit:
                    return
                yield item

    return Head


class _Recorder:
    """Wraps the processor: keeps the media counts of each record it processes."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.media_types = getattr(processor, "media_types", None)  # what SlotStream reads
        self.last: Counter = Counter()

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        self.last = Counter(p["type"] for m in messages for p in m["content"] if p["type"] in MEDIA)
        return self.processor(messages)
