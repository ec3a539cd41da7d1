"""Bad-record reasons, the exception carrying them, and per-worker counters."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("lmms_data")

#: Every reason a record can be rejected for; counters and metrics use these names.
BAD_REASONS = (
    "malformed_json",  # a JSONL line that is not a JSON object
    "malformed_record",  # no messages/conversations, wrong types, unknown roles
    "empty_conversation",  # no turns, or only empty text
    "no_assistant",  # nothing to supervise
    "missing_media",  # media file does not exist (or escapes data_folder)
    "bad_image",  # unreadable / corrupt image
    "bad_video",  # unreadable / corrupt video
    "bad_label",  # a class label that is not an integer in [0, num_classes) (diffusion data)
    "too_few_frames",  # a clip shorter than the smallest frame bucket (diffusion data)
    "bad_aspect",  # an image/clip far from every resolution bucket's aspect (diffusion data)
    "bad_audio",  # unreadable / corrupt audio
    "unsupported_media",  # a media kind the processor cannot handle
    "media_mismatch",  # placeholder count != media count
    "too_long",  # longer than packing_length
    "corrupt_file",  # a truncated/corrupt Parquet or Arrow file, row group or batch, or gzip
)


class BadRecordError(ValueError):
    """A record that cannot become a sample; ``reason`` is one of ``BAD_REASONS``."""

    def __init__(self, reason: str, message: str, location: str = "") -> None:
        assert reason in BAD_REASONS, reason
        self.reason = reason
        self.detail = message
        self.location = location
        super().__init__(f"[{reason}] {message}" + (f" at {location}" if location else ""))

    def at(self, location: str) -> BadRecordError:
        return BadRecordError(self.reason, self.detail, location)


class BadRecordRatioExceeded(RuntimeError):
    """Raised when the share of bad records passes ``max_bad_record_ratio``."""


@dataclass(kw_only=True, slots=True)
class BadRecordStats:
    """Counts of seen and rejected records (per worker; the loader sums them)."""

    seen: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # last few "reason: location: detail"

    def add(self, err: BadRecordError, max_examples: int = 20) -> None:
        self.bad[err.reason] = self.bad.get(err.reason, 0) + 1
        self.examples.append(f"{err.reason}: {err.location}: {err.detail}")
        del self.examples[:-max_examples]
        n = self.bad[err.reason]
        if n <= 3 or n & (n - 1) == 0:  # first few, then at powers of two
            logger.warning(
                "skipping bad record (%s #%d) at %s: %s", err.reason, n, err.location, err.detail
            )

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.bad.items())) or "none"
        ex = "\n  ".join(self.examples[-5:])
        return f"{self.num_bad}/{self.seen} records bad ({reasons}); last examples:\n  {ex}"

    def to_dict(self) -> dict:
        return {"seen": self.seen, "bad": dict(self.bad), "examples": list(self.examples)}

    @classmethod
    def from_dict(cls, d: dict) -> BadRecordStats:
        return cls(seen=d["seen"], bad=dict(d["bad"]), examples=list(d["examples"]))
