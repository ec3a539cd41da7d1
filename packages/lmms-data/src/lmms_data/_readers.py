"""Shard discovery and readers: JSONL (plain, gzip), Parquet, Arrow IPC / Feather, HF save_to_disk.

A dataset is cut into *units*, the smallest pieces of work handed to one (rank, worker) slot: a
Parquet row group, an Arrow record batch, a byte range of a plain JSONL file, a whole gzip JSONL
file. When a dataset has fewer units than slots, units are split into row (or byte) ranges so that
every slot gets work; only then may two slots open the same row group (each reads its own rows).

Positions inside a unit are plain ints (row index, or byte offset for plain JSONL), so a reader can
resume mid-unit and re-read a buffered record by ``(unit, pos)`` without holding its content.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from lmms_data._errors import BadRecordError
from lmms_data._json_array import NO_END, iter_array, read_element, sniff, split_points
from lmms_data._remote import file_size, is_url, open_parquet, remote_files

JSONL_CHUNK_BYTES = 64 << 20
_EXT = {
    ".jsonl": "jsonl",
    ".json": "json",  # JSON Lines or one JSON array: sniffed (lmms_data._json_array)
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
_READ_BATCH = 32  # rows per Arrow batch when streaming a row group (bounds memory)


@dataclass(frozen=True, slots=True)
class Unit:
    """One piece of work. ``lo``/``hi``: row range inside ``part`` (byte range for plain JSONL)."""

    file: str
    fmt: str  # jsonl | jsonl.gz | json_array | parquet | arrow_file | arrow_stream
    part: int  # row group / record batch index (0 for JSONL)
    lo: int
    hi: int  # exclusive; -1 = to the end
    base: int  # index of the unit's first record in the file (-1 if unknown)

    def location(self, pos: int, ordinal: int) -> str:
        if self.fmt == "jsonl":
            return f"{self.file} line {ordinal + 1}" if self.lo == 0 else f"{self.file} @byte {pos}"
        if self.fmt == "json_array":
            return f"{self.file} record {self.base + ordinal} (@byte {pos})"
        return f"{self.file} record {self.base + pos - self.lo}" if self.base >= 0 else self.file


def detect_format(path: str) -> str:
    p = path.lower()
    for ext in sorted(_EXT, key=len, reverse=True):
        if p.endswith(ext):
            return _EXT[ext]
    raise ValueError(
        f"cannot detect the format of {path!r} from its extension (known: {sorted(_EXT)}); "
        "set dataset_format"
    )


def _is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(
        os.path.join(path, "dataset_info.json")
    )


def list_files(path: str, fmt: str | None) -> list[tuple[str, str]]:
    """(file, format) pairs of one ``dataset_path`` entry, sorted for a stable order."""
    if is_url(path):  # Parquet behind a URL (hf://, s3://, ...): lmms_data._remote
        return [(f, "parquet") for f in remote_files(path, fmt)]
    if os.path.isdir(path) and (fmt == "hf" or (fmt is None and _is_hf_dir(path))):
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        return [(os.path.join(path, d["filename"]), "arrow") for d in state["_data_files"]]
    if any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    elif os.path.isdir(path):
        files = sorted(
            os.path.join(root, n)
            for root, _, names in os.walk(path)
            for n in names
            if not n.startswith(".")
        )
        if fmt is None:
            files = [f for f in files if any(f.lower().endswith(e) for e in _EXT)]
    elif os.path.exists(path):
        files = [path]
    else:
        raise FileNotFoundError(f"dataset_path {path!r} does not exist")
    if not files:
        raise FileNotFoundError(f"no data files found for dataset_path {path!r}")
    out = []
    for f in files:
        ff = fmt if fmt not in (None, "hf") else detect_format(f)
        if ff == "json" or (fmt is None and ff == "jsonl.gz"):
            ff = sniff(f)  # `[` first: one JSON array (plain or gzip); else JSON Lines
        if ff == "jsonl" and f.lower().endswith(".gz"):
            ff = "jsonl.gz"
        out.append((f, ff))
    return out


def _open_arrow(file: str) -> tuple[str, Any]:
    src = pa.memory_map(file, "r")
    try:
        return "arrow_file", pa.ipc.open_file(src)
    except pa.ArrowInvalid:
        src.seek(0)
        return "arrow_stream", pa.ipc.open_stream(src)


# Errors pyarrow raises for a truncated or corrupt Parquet/Arrow file (ArrowInvalid is a
# ValueError, ArrowIOError an OSError).
_CORRUPT = (pa.ArrowException, OSError, EOFError, zlib.error)


def unreadable_reason(file: str, fmt: str) -> str | None:
    """Why ``file``'s Parquet footer / Arrow schema cannot be read (one line), or None."""
    try:
        _file_units(file, fmt)
    except _CORRUPT as e:
        return " ".join(str(e).split())[:300] or type(e).__name__
    return None


def file_units(file: str, fmt: str) -> list[Unit]:
    """The units of one file. An empty file has none; a Parquet/Arrow file whose metadata cannot
    be read (truncated, corrupt) is one unit of format ``corrupt``, which yields one bad record
    of reason ``corrupt_file``: skipped and counted, or raised under ``bad_record_policy: raise``."""
    if file_size(file) == 0:
        return []
    try:
        return _file_units(file, fmt)
    except _CORRUPT:
        if fmt not in ("parquet", "arrow"):
            raise
        return [Unit(file, "corrupt", 0, 0, 1, -1)]


def _file_units(file: str, fmt: str) -> list[Unit]:
    if fmt == "parquet":
        md = open_parquet(file).metadata
        units, base = [], 0
        for i in range(md.num_row_groups):
            n = md.row_group(i).num_rows
            units.append(Unit(file, "parquet", i, 0, n, base))
            base += n
        return units
    if fmt == "arrow":
        kind, reader = _open_arrow(file)
        units, base = [], 0
        if kind == "arrow_file":
            sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
        else:
            sizes = [b.num_rows for b in reader]
        for i, n in enumerate(sizes):
            units.append(Unit(file, kind, i, 0, n, base))
            base += n
        return units
    if fmt == "jsonl":
        size = os.path.getsize(file)
        n = max(1, math.ceil(size / JSONL_CHUNK_BYTES))
        step = math.ceil(size / n) if size else 1
        return [Unit(file, "jsonl", 0, i * step, min(size, (i + 1) * step), -1) for i in range(n)]
    if fmt == "jsonl.gz":
        return [Unit(file, "jsonl.gz", 0, 0, -1, 0)]
    if fmt == "json_array":
        gz = file.lower().endswith(".gz")
        return [Unit(file, "json_array", 0, 0, NO_END if gz else os.path.getsize(file), 0)]
    raise ValueError(f"unknown format {fmt!r}")


def split_unit(u: Unit, k: int) -> list[Unit]:
    """Split one unit into ``k`` contiguous sub-ranges (rows, bytes, or lines for gzip)."""
    if k <= 1:
        return [u]
    if u.fmt == "json_array":  # boundaries must be element starts: one framing pass finds them
        starts = split_points(u.file, k)
        ends = [p for p, _ in starts[1:]] + [u.hi]
        return [Unit(u.file, u.fmt, 0, p, e, n) for (p, n), e in zip(starts, ends, strict=True)]
    hi = u.hi
    if u.fmt == "jsonl.gz" and hi < 0:
        with gzip.open(u.file, "rb") as f:
            hi = sum(1 for _ in f)
    n = hi - u.lo
    bounds = [u.lo + (n * i) // k for i in range(k + 1)]
    return [
        Unit(u.file, u.fmt, u.part, a, b, u.base) for a, b in itertools.pairwise(bounds) if b > a
    ] or [u]


def discover_units(path: str, fmt: str | None, min_units: int) -> list[Unit]:
    """All units of one dataset entry, split until there are at least ``min_units`` (if possible)."""
    units = [u for f, ff in list_files(path, fmt) for u in file_units(f, ff)]
    units = [u for u in units if u.hi != u.lo]
    if 0 < len(units) < min_units:
        k = math.ceil(min_units / len(units))
        units = [s for u in units for s in split_unit(u, k)]
    if not units:
        files = [f for f, _ in list_files(path, fmt)]
        empty = [f for f in files if file_size(f) == 0]
        what = (
            f"{len(empty)} of {len(files)} file(s) are empty, e.g. {empty[0]!r}"
            if empty
            else ("its files have no rows")
        )
        raise ValueError(f"dataset_path {path!r} holds no records ({what})")
    return units


def _rows(table: pa.Table | pa.RecordBatch) -> list[dict[str, Any]]:
    return table.to_pylist()


def _parse_line(line: bytes, unit: Unit, pos: int, ordinal: int) -> dict | BadRecordError:
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        return BadRecordError("malformed_json", str(e)[:200], unit.location(pos, ordinal))
    if not isinstance(rec, dict):
        return BadRecordError(
            "malformed_json", "line is not a JSON object", unit.location(pos, ordinal)
        )
    return rec


def iter_unit(unit: Unit, pos: int | None = None) -> Iterator[tuple[int, int, Any]]:
    """Yield ``(pos, next_pos, record)`` from ``pos`` (default: start) to the end of the unit.

    ``record`` is a dict, or a ``BadRecordError`` for an unparsable line (so it is counted).
    Blank JSONL lines are skipped silently.
    """
    start = unit.lo if pos is None else pos
    if unit.fmt == "jsonl":
        with open(unit.file, "rb") as f:
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # a line that began in the previous unit
            p = f.tell()
            while p < unit.hi:
                line = f.readline()
                if not line:
                    break
                q = f.tell()
                if line.strip():
                    yield p, q, line
                p = q
        return
    if unit.fmt == "json_array":
        yield from iter_array(unit.file, unit.lo, unit.hi, pos)
        return
    if unit.fmt == "jsonl.gz":
        i = -1
        try:
            with gzip.open(unit.file, "rb") as f:
                for i, line in enumerate(f):
                    if unit.hi >= 0 and i >= unit.hi:
                        break
                    if i >= start and line.strip():
                        yield i, i + 1, line
        except _CORRUPT as e:  # a truncated gzip: the rest of the file is one bad record
            at = max(i + 1, start)
            detail = " ".join(str(e).split())[:200] or type(e).__name__
            yield at, at + 1, BadRecordError("corrupt_file", f"unreadable from line {at}: {detail}")
        return
    if unit.fmt == "corrupt":
        yield 0, 1, _corrupt(unit)
        return
    at = start  # the next row: a corrupt part is one bad record from there to the unit's end
    try:
        for i, row in _iter_rows(unit, start):
            at = i + 1
            yield i, i + 1, row
    except _CORRUPT as e:
        yield at, unit.hi, _corrupt(unit, e)


def _corrupt(unit: Unit, exc: BaseException | None = None) -> BadRecordError:
    """The bad record standing for an unreadable file (``corrupt`` unit) or part of one."""
    if exc is None:
        reason = unreadable_reason(
            unit.file, "parquet" if unit.file.endswith(".parquet") else "arrow"
        )
        return BadRecordError("corrupt_file", f"unreadable file: {reason}", unit.file)
    part = "row group" if unit.fmt == "parquet" else "record batch"
    detail = " ".join(str(exc).split())[:300] or type(exc).__name__
    return BadRecordError("corrupt_file", f"{part} {unit.part} is unreadable: {detail}", unit.file)


def _iter_rows(unit: Unit, start: int) -> Iterator[tuple[int, dict]]:
    if unit.fmt == "parquet":
        pf = open_parquet(unit.file)
        i = 0
        for batch in pf.iter_batches(batch_size=_READ_BATCH, row_groups=[unit.part]):
            j = i + batch.num_rows
            if j > start and i < unit.hi:
                a, b = max(start, i) - i, min(unit.hi, j) - i
                for k, row in enumerate(_rows(batch.slice(a, b - a))):
                    yield i + a + k, row
            if j >= unit.hi:
                break
            i = j
        return
    batch = _arrow_batch(unit)
    for k in range(start, unit.hi, _READ_BATCH):
        for m, row in enumerate(_rows(batch.slice(k, min(_READ_BATCH, unit.hi - k)))):
            yield k + m, row


def _arrow_batch(unit: Unit) -> pa.RecordBatch:
    kind, reader = _open_arrow(unit.file)
    if kind == "arrow_file":
        return reader.get_batch(unit.part)
    for i, b in enumerate(reader):
        if i == unit.part:
            return b
    raise IndexError(f"{unit.file} has no record batch {unit.part}")


def read_at(unit: Unit, positions: list[int]) -> dict[int, Any]:
    """Re-read the records at ``positions`` of ``unit`` (used to rebuild buffers on resume)."""
    want = set(positions)
    out: dict[int, Any] = {}
    if unit.fmt == "jsonl":
        with open(unit.file, "rb") as f:
            for p in sorted(want):
                f.seek(p)
                out[p] = f.readline()
        return out
    if unit.fmt == "json_array":
        return {p: read_element(unit.file, p) for p in want}
    if unit.fmt == "jsonl.gz":
        last = max(want)
        with gzip.open(unit.file, "rb") as f:
            for i, line in enumerate(f):
                if i in want:
                    out[i] = line
                if i >= last:
                    break
        return out
    try:
        if unit.fmt == "corrupt":
            raise OSError("unreadable file")
        if unit.fmt == "parquet":
            table = open_parquet(unit.file).read_row_group(unit.part)
        else:
            table = _arrow_batch(unit)
    except _CORRUPT as e:
        return {p: _corrupt(unit, None if unit.fmt == "corrupt" else e) for p in want}
    for p in want:
        out[p] = table.slice(p, 1).to_pylist()[0]
    return out


def decode_raw(unit: Unit, pos: int, ordinal: int, raw: Any) -> dict | BadRecordError:
    """JSONL lines arrive as bytes and are parsed here (so parse errors are bad records)."""
    if isinstance(raw, bytes | bytearray):
        return _parse_line(raw, unit, pos, ordinal)
    return raw


__all__ = [
    "Unit",
    "decode_raw",
    "detect_format",
    "discover_units",
    "iter_unit",
    "read_at",
    "unreadable_reason",
]
