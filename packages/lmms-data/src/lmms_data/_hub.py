"""Hugging Face Hub ids (``org/name`` or ``org/name@revision``) resolved to local cache folders.

A config names a model, tokenizer, processor or dataset either as a local folder or as a Hub id;
`resolve_hub_path` turns an id into the snapshot folder of the standard Hugging Face cache
(``HF_HUB_CACHE``, else ``$HF_HOME/hub``), downloading only the files a training run reads:
configs, safetensors weights and their index, tokenizer, processor and chat-template files (no
``.bin``/``.pt``/``.msgpack``/ONNX copies when safetensors exist). huggingface_hub does the work
(its progress bar, resumable downloads, cache layout). Everything after that reads the folder as a
local one.

One download per node: the processes of a node serialise on a file lock in the cache, so the
first downloads while the others wait (``timeout_s``, then a clear error), then find every file
cached. Offline (``HF_HUB_OFFLINE=1``) only the cache is read; an id that is not there is a
`HubError` naming the id and the cache folder.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
from pathlib import Path

__all__ = ["HubError", "hub_cache_dir", "is_hub_id", "resolve_hub_path", "split_hub_id"]

# What each kind of folder needs. Subfolders match too (fnmatch's `*` crosses `/`): diffusers
# layouts keep `vae/config.json`, `transformer/*.safetensors`.
_PROCESSOR_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_WEIGHTS = {"safetensors": ["*.safetensors"], "bin": ["*.bin"]}
# A dataset repo's records, by preference: Parquet (what the Hub serves for every dataset), then
# `save_to_disk` Arrow folders (their state.json / dataset_info.json say which files), then JSON
# Lines / JSON arrays. Only one kind is read, so metadata JSON beside Parquet shards is no data.
_DATA_KINDS = (
    ("*.parquet", ["*.parquet"]),
    ("*.arrow", ["*.arrow", "*.json"]),
    ("*.json*", ["*.jsonl", "*.jsonl.gz", "*.json", "*.json.gz"]),
)
_TRAIN_SPLIT = (
    os.path.join("**", "train", "**", "*.parquet"),
    os.path.join("**", "train[-_.]*.parquet"),
)
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
KINDS = ("model", "processor", "dataset")


class HubError(ValueError):
    """A Hub id that cannot be resolved (not cached offline, unknown, not downloadable)."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub computes it, read from the
    environment now (HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def is_hub_id(value: str) -> bool:
    """True when ``value`` reads as ``org/name[@revision]`` and is no existing local path."""
    if not isinstance(value, str) or os.path.exists(value) or not _ID.match(value):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value.split("@", 1)[0])
    except HFValidationError:
        return False
    return True


def split_hub_id(value: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; no ``@``: revision None (the default branch)."""
    repo, _, rev = value.partition("@")
    return repo, rev or None


def _patterns(
    kind: str, repo: str, revision: str | None, repo_type: str, endpoint: str | None
) -> list[str]:
    if kind == "processor":
        return list(_PROCESSOR_FILES)
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).repo_info(repo, revision=revision, repo_type=repo_type)
    files = [s.rfilename for s in info.siblings or []]
    if kind == "dataset":
        for marker, patterns in _DATA_KINDS:
            if any(fnmatch.fnmatch(f, marker) for f in files):
                return patterns
        return list(_DATA_KINDS[-1][1])
    weights = "safetensors" if any(f.endswith(".safetensors") for f in files) else "bin"
    return [*_PROCESSOR_FILES, *_WEIGHTS[weights]]


def resolve_hub_path(value: str, *, kind: str = "model", timeout_s: float = 7200.0) -> str:
    """The local folder for ``value``: itself when it is no Hub id, else the cache snapshot of
    ``org/name[@revision]`` (downloaded first unless offline). ``kind``: ``model`` (configs,
    weights, tokenizer/processor files), ``processor`` (no weights) or ``dataset`` (data files
    of a dataset repo; the result is then a glob of its Parquet shards if it has any). Raises
    `HubError` with one line naming the id and the cache folder."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not is_hub_id(value):
        return value
    repo, revision = split_hub_id(value)
    repo_type = "dataset" if kind == "dataset" else "model"
    cache = hub_cache_dir()
    if _offline():
        found = _cached(repo, revision, repo_type, cache)
        if found is None:
            raise HubError(
                f"{value!r} is no local path, and as a Hub {repo_type} id it is not in the Hugging "
                f"Face cache {cache}; HF_HUB_OFFLINE=1 forbids downloading it (download it first: "
                f"hf download {repo}"
                + (f" --revision {revision}" if revision else "")
                + (" --repo-type dataset" if kind == "dataset" else "")
                + "; docs/weights.md)"
            )
        return _data_files(found) if kind == "dataset" else found
    found = _download(value, kind, repo, revision, repo_type, cache, timeout_s)
    return _data_files(found) if kind == "dataset" else found


def _data_files(snapshot: str) -> str:
    """A dataset snapshot as a `dataset_path`: a recursive glob of its Parquet shards when it has
    any (a full `hf download` also holds metadata JSON) - of the train split's alone when the
    Hub's split naming marks one (`train/` folders, `train-*` / `train_*` files) - else the folder."""
    if not any(Path(snapshot).rglob("*.parquet")):
        return snapshot
    for pattern in _TRAIN_SPLIT:
        if glob.glob(os.path.join(snapshot, pattern), recursive=True):
            return os.path.join(snapshot, pattern)
    return os.path.join(snapshot, "**", "*.parquet")


def _cached(repo: str, revision: str | None, repo_type: str, cache: Path) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            repo, revision=revision, repo_type=repo_type, cache_dir=cache, local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def _download(
    value: str, kind: str, repo: str, revision: str | None, repo_type: str, cache: Path,
    timeout_s: float,
) -> str:  # fmt: skip
    """Download under the node's lock; the Hub unreachable: the cached snapshot if there is one."""
    from filelock import FileLock, Timeout
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    lock_dir = cache / ".locks" / "lmms"
    lock_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(f"{repo_type}:{value}".encode()).hexdigest()[:16]
    try:
        with FileLock(str(lock_dir / f"{key}.lock"), timeout=timeout_s):
            patterns = _patterns(kind, repo, revision, repo_type, endpoint)
            return snapshot_download(
                repo, revision=revision, repo_type=repo_type, cache_dir=cache,
                allow_patterns=patterns, endpoint=endpoint,
            )  # fmt: skip
    except Timeout:
        raise HubError(
            f"waited {timeout_s:.0f} s for another process of this node to download {value!r} "
            f"into {cache} (lock {lock_dir / key}.lock): download it first (hf download {repo})"
        ) from None
    except Exception as exc:  # HTTP status, DNS, refused, TLS...: the HTTP library's own types
        # (httpx, httpx2 or requests, by huggingface_hub version); the cache may still hold it
        missing = isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError)
        found = None if missing else _cached(repo, revision, repo_type, cache)
        if found is not None:  # the Hub unreachable (no network): what the cache holds
            return found
        first = " ".join(str(exc).split())[:300]
        raise HubError(
            f"{value!r} is no local path, and as a Hub {repo_type} id it cannot be downloaded "
            f"into {cache}: {first}"
        ) from None
