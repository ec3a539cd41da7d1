"""Parquet shards behind a URL (``hf://datasets/org/name/...``, ``s3://...``, any fsspec
filesystem), streamed without downloading the dataset first.

A URL names a Parquet file, a folder (every ``.parquet`` below it) or a glob. The readers treat
such a file as a local one: its row groups are the units, a record's position is its row, so the
loader's state resumes exactly and a referenced record is re-read by one ranged request for its
row group. ``hf://`` is huggingface_hub's `HfFileSystem` (a revision: ``hf://datasets/org/name@rev``;
``HF_TOKEN`` for private repos). Only Parquet is read this way: it is what the Hub serves for
every dataset, and its row groups are the random access resume needs.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "dataset_path_exists",
    "file_size",
    "is_url",
    "open_parquet",
    "remote_files",
    "remote_names",
    "url_exists",
]


def is_url(path: str) -> bool:
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def remote_files(url: str, fmt: str | None) -> list[str]:
    """The Parquet files a URL names (sorted, as URLs)."""
    if fmt not in (None, "parquet"):
        raise ValueError(
            f"dataset_path {url!r}: only Parquet streams from a URL (dataset_format: {fmt})"
        )
    fs, root = _fs(url)
    if any(c in root for c in "*?["):
        found = fs.glob(root)
    elif fs.isdir(root):
        found = [p for p in fs.find(root) if p.endswith(".parquet")]
    elif fs.exists(root):
        found = [root]
    else:
        raise FileNotFoundError(f"dataset_path {url!r} does not exist")
    if not found:
        raise FileNotFoundError(f"no Parquet files found for dataset_path {url!r}")
    return [fs.unstrip_protocol(p) for p in sorted(found)]


def file_size(file: str) -> int:
    if is_url(file):
        fs, path = _fs(file)
        return int(fs.size(path))
    return os.path.getsize(file)


def open_parquet(file: str) -> Any:
    """A `pyarrow.parquet.ParquetFile` over a local path or a URL (ranged reads)."""
    import pyarrow.parquet as pq

    if not is_url(file):
        return pq.ParquetFile(file)
    fs, path = _fs(file)
    return pq.ParquetFile(fs.open(path, "rb"))


def url_exists(url: str) -> bool:
    fs, root = _fs(url)
    return bool(fs.glob(root)) if any(c in root for c in "*?[") else fs.exists(root)


def remote_names(url: str, files: list[str]) -> list[str]:
    """``files`` (URLs from `remote_files`) named relative to the dataset root ``url`` names (the
    folder itself, or the folder of a file or glob), as the local fingerprint names them."""
    import posixpath

    fs, root = _fs(url)
    paths = [_fs(f)[1] for f in files]
    base = root if fs.isdir(root) else posixpath.dirname(posixpath.commonpath(paths))
    return [posixpath.relpath(p, base) for p in paths]


def dataset_path_exists(path: str) -> bool:
    """Whether a `dataset_path` entry names something: a local file or folder, a glob that matches
    (``**`` recursive, as the readers expand it), or a URL that exists."""
    import glob

    if is_url(path):
        return url_exists(path)
    return os.path.exists(path) or bool(glob.glob(path, recursive=True))
