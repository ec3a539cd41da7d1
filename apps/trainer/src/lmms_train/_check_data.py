"""`lmms-train check-data CONFIG [--num-records N]`: the data path of a run without its model.

Reads the first N records of `dataset_config` through the same readers, record adapter, media
resolution and processor the training run uses (one process, no workers, no shuffle) and prints
what a user needs to see before spending a GPU hour: records/s, token lengths, supervised share,
media counts, how many fit `packing_length`, bad records by reason with an example each, and one
sample rendered with its supervised spans marked `[[...]]` (media placeholder runs collapsed).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmms_train._errors import UserError
from lmms_train.config import TrainConfig

__all__ = ["DataReport", "check_data", "render_sample"]

_MEDIA = ("image", "video", "audio")


@dataclass(kw_only=True, slots=True)
class DataReport:
    """What `check_data` measured (also printed by `DataReport.text()`)."""

    paths: list[str]
    processor: str
    seconds: float = 0.0
    seen: int = 0
    lengths: list[int] = field(default_factory=list)  # tokens per good record
    supervised: list[int] = field(default_factory=list)  # label tokens per good record
    media: Counter = field(default_factory=Counter)  # parts per media type over good records
    media_tokens: list[int] = field(default_factory=list)  # placeholder tokens per good record
    bad: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # first example per reason
    packing_length: int = 0
    packing: bool = True
    sample: str = ""
    total_records: int | None = None  # from Parquet/Arrow metadata (None: not known cheaply)
    accum: int = 1  # trainer_args.gradient_accumulation_steps

    @property
    def good(self) -> int:
        return len(self.lengths)

    def text(self) -> str:
        g = max(self.good, 1)
        lines = [
            f"check-data: {self.seen} records of {', '.join(self.paths)} (processor {self.processor})"
        ]
        rate = self.seen / self.seconds if self.seconds > 0 else float("inf")
        lines.append(
            f"  speed      {rate:,.1f} records/s ({self.seconds:.2f} s, one process, no workers)"
        )
        lines.append(f"  records    {self.good:,} good, {sum(self.bad.values()):,} bad")
        if self.lengths:
            a = np.asarray(self.lengths)
            sup = int(sum(self.supervised))
            lines.append(
                f"  tokens     per record min {a.min():,} / median {int(np.median(a)):,} / p95 "
                f"{int(np.percentile(a, 95)):,} / max {a.max():,}; {a.sum():,} in all, "
                f"{sup:,} supervised ({100 * sup / max(a.sum(), 1):.1f}%)"
            )
            if self.packing:
                lines.append(
                    f"  packing    packing_length {self.packing_length:,}: about "
                    f"{self.packing_length / a.mean():.1f} records per packed row"
                )
            if self.total_records is not None:
                per_row = self.packing_length / a.mean() if self.packing else 1.0
                good = self.good / max(self.seen, 1)
                rows = self.total_records * good / per_row
                lines.append(
                    f"  epoch      {self.total_records:,} records in the dataset: about "
                    f"{rows / self.accum:,.0f} steps per epoch on one data-parallel rank "
                    f"(gradient_accumulation_steps {self.accum}; divide by the ranks; full packs)"
                )
        counts = ", ".join(
            f"{t} {self.media[t]:,} ({self.media[t] / g:.2f}/record)" for t in _MEDIA
        )
        mt = np.asarray(self.media_tokens or [0])
        lines.append(
            f"  media      {counts}; media tokens per record median {int(np.median(mt)):,}, max {mt.max():,}"
        )
        if self.bad:
            reasons = ", ".join(f"{k}={v:,}" for k, v in sorted(self.bad.items()))
            lines.append(f"  bad        {reasons}")
            lines += [f"             e.g. {r}: {e}" for r, e in sorted(self.examples.items())]
        if self.sample:
            lines.append("sample (the first good record; [[...]] is supervised):")
            lines += ["  " + ln for ln in self.sample.splitlines()]
        return "\n".join(lines)  # fmt: skip


def render_sample(tokenizer: Any, input_ids: np.ndarray, labels: np.ndarray) -> str:
    """Decoded tokens with supervised runs in `[[...]]` and runs of one repeated special token
    collapsed to `<tok>x N`."""
    ids = [int(i) for i in input_ids]
    sup = [int(v) != -100 for v in labels]
    special = set(getattr(tokenizer, "all_special_ids", []))
    out, i = [], 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and sup[j] == sup[i]:
            j += 1
        text = _decode_run(tokenizer, ids[i:j], special)
        out.append(f"[[{text}]]" if sup[i] else text)
        i = j
    return "".join(out)


def _decode_run(tokenizer: Any, ids: list[int], special: set[int]) -> str:
    parts, k = [], 0
    while k < len(ids):
        m = k + 1
        while m < len(ids) and ids[m] == ids[k]:
            m += 1
        if m - k > 3:  # a media placeholder run
            tok = tokenizer.convert_ids_to_tokens(ids[k])
            parts.append(f"{tok}x{m - k}")
        else:
            parts.append(tokenizer.decode(ids[k:m], skip_special_tokens=False))
        k = m
    return "".join(parts)


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

    def __init__(self, processor: Any, packing_length: int, packing: bool) -> None:
        self.processor, self.packing_length, self.packing = processor, packing_length, packing
        self.media_types = getattr(processor, "media_types", None)
        self.last: Counter = Counter()

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        self.last = Counter(
            p["type"] for m in messages for p in m["content"] if p["type"] in _MEDIA
        )
        return self.processor(messages)


def check_data(cfg: TrainConfig, num_records: int = 200) -> DataReport:
    """Process the first `num_records` records of the run's data and measure them."""
    from lmms_data import SlotStream, build_processor
    from lmms_data._loader import discover
    from lmms_models import MixedGeneration
    from lmms_train._data_setup import _check_inputs, data_config, prepare_inputs
    from lmms_train._dist import DistEnv
    from lmms_train._model_setup import resolve_spec

    if num_records < 1:
        raise UserError("check-data: --num-records must be >= 1")
    spec = resolve_spec(cfg)
    prepare_inputs(cfg, DistEnv(), spec)
    dcfg, finish = data_config(cfg, spec), None
    if isinstance(spec, MixedGeneration):  # packed model-side: each sample packed alone
        from lmms_train._data_setup import _model_side_packing

        dcfg, finish = _model_side_packing(cfg, spec, dcfg, DistEnv())
    _check_inputs(cfg, spec, dcfg)
    dcfg = dataclasses.replace(dcfg, num_workers=0, shuffle=False, num_epochs=1,
                               bad_record_policy="skip", max_bad_record_ratio=1.0)  # fmt: skip
    try:
        processor = build_processor(dcfg.processor_family, dcfg.processor_path, dcfg)
        units = discover(dcfg, 1)
    except (OSError, ValueError) as exc:
        raise UserError(f"check-data: {exc}") from None
    rec = _Recorder(processor, dcfg.packing_length, dcfg.packing)
    nopack = dataclasses.replace(dcfg, packing=False)  # one sample per batch: each measured alone
    stream = _head(SlotStream)(nopack, units, rec, slot=0, n_slots=1, as_torch=False)
    stream.limit = num_records
    media_ids = {
        getattr(processor, a, None) for a in ("image_token_id", "video_token_id", "audio_token_id")
    }
    media_ids.discard(None)
    report = DataReport(paths=dcfg.paths, processor=f"{dcfg.processor_family} from {dcfg.processor_path}",
                        packing_length=dcfg.packing_length, packing=dcfg.packing,
                        accum=cfg.trainer_args.gradient_accumulation_steps)  # fmt: skip
    if all(u.fmt in ("parquet", "arrow_file", "arrow_stream") for src in units for u in src):
        report.total_records = sum(u.hi - u.lo for src in units for u in src)
    checking_len = dcfg.packing
    t0 = time.perf_counter()
    for batch in stream:
        if finish is not None:
            batch = finish(batch)
        ids, labels = (
            np.asarray(batch["input_ids"]).reshape(-1),
            np.asarray(batch["labels"]).reshape(-1),
        )
        if finish is not None:  # its labels are next-token targets: mark the targets themselves
            labels = np.concatenate([[-100], labels[:-1]])
        if checking_len and ids.size > dcfg.packing_length:
            report.bad["too_long"] = report.bad.get("too_long", 0) + 1
            report.examples.setdefault(
                "too_long", f"{ids.size} tokens > packing_length {dcfg.packing_length}"
            )
        else:
            report.lengths.append(int(ids.size))
            report.supervised.append(
                int((labels != -100).sum()) + int(batch.get("num_fm_tokens", 0))
            )  # + noised latent tokens (bagel's flow matching)
            report.media.update(rec.last)
            report.media_tokens.append(int(np.isin(ids, list(media_ids)).sum()) if media_ids else 0)
            if not report.sample:
                report.sample = render_sample(processor.tokenizer, ids, labels)
    report.seconds = time.perf_counter() - t0
    report.seen = stream.stats.seen
    for reason, n in stream.stats.bad.items():
        report.bad[reason] = report.bad.get(reason, 0) + n
    for ex in stream.stats.examples:
        reason, _, rest = ex.partition(": ")
        report.examples.setdefault(reason, rest)
    return report
