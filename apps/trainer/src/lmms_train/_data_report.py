"""What `lmms-train check-data` measured (`DataReport`) and how it prints: records/s, token
lengths, supervised share, media counts, how many fit `packing_length` (or the shapes of latent
batches), bad records by reason with an example each, and one sample rendered with its
supervised spans marked `[[...]]` (media placeholder runs collapsed). Every data plan fills it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MEDIA", "DataReport", "render_sample"]

MEDIA = ("image", "video", "audio")


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
    batch_size: int = 1  # records per row without packing (latent batches: extra.batch_size)
    shapes: Counter = field(default_factory=Counter)  # latent batches: records per bucket shape

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
                per_row = self.packing_length / a.mean() if self.packing else self.batch_size
                good = self.good / max(self.seen, 1)
                rows = self.total_records * good / per_row
                lines.append(
                    f"  epoch      {self.total_records:,} records in the dataset: about "
                    f"{rows / self.accum:,.0f} steps per epoch on one data-parallel rank "
                    f"(gradient_accumulation_steps {self.accum}; divide by the ranks; full "
                    f"{'packs' if self.packing else 'batches'})"
                )
        if self.shapes:
            lines.append("  shapes     " + ", ".join(
                f"{k} {n:,} ({100 * n / g:.1f}%)" for k, n in self.shapes.most_common()
            ) + f"; batch_size {self.batch_size}")  # fmt: skip
        counts = ", ".join(f"{t} {self.media[t]:,} ({self.media[t] / g:.2f}/record)" for t in MEDIA)
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
