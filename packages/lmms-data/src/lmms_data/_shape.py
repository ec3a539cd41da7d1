"""A look at the first record of each source before streaming: a file whose records have a shape
no adapter understands fails at start-up with one line naming the accepted shapes, instead of
every record becoming a ``malformed_record`` bad record many steps later."""

from __future__ import annotations

from lmms_data._config import DatasetConfig
from lmms_data._errors import BadRecordError
from lmms_data._json_array import DataShapeError
from lmms_data._readers import Unit, decode_raw, iter_unit
from lmms_data._records import ACCEPTED_RECORDS
from lmms_data._registry import DATASET_REGISTRY


def check_shape(cfg: DatasetConfig, sources: list[list[Unit]]) -> None:
    """Raise ``DataShapeError`` if the first record of a source is a JSON object / row that the
    ``dataset_type`` adapter maps to neither ``messages`` nor ``conversations``.

    Unparsable first records are left to the bad-record policy (one bad line is not a shape).
    """
    adapter = DATASET_REGISTRY.get(cfg.dataset_type)
    for units in sources:
        unit = units[0]
        it = iter_unit(unit)
        first = next(it, None)
        it.close()
        if first is None:
            continue
        rec = decode_raw(unit, first[0], 0, first[2])
        if isinstance(rec, BadRecordError):
            continue
        try:
            out = adapter(rec)
        except Exception:  # the adapter's own problem with one record: a bad record later
            continue
        if isinstance(out, dict) and any(  # a chat record, or a preference pair of two
            out.get(k) is not None for k in ("messages", "conversations", "pair")
        ):
            continue
        keys = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise DataShapeError(
            f"{unit.file}: records have keys {keys}, a shape dataset_type "
            f"{cfg.dataset_type!r} does not read; accepted: {ACCEPTED_RECORDS}"
        )


__all__ = ["DataShapeError", "check_shape"]
