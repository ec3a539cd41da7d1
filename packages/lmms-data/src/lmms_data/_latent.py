"""Latent batches for diffusion transformers: bucketed, resumable, one shape per batch.

``build_latent_loader(cfg, dp_rank, dp_world, tokens_fn=..., tokenizer=...)`` reads records from
Parquet / JSONL shards (``dataset_config.dataset_path``) and yields the *latent batches* of
``lmms_models._diffusion`` (docs/contracts.md). A record is one of

* ``{"image": bytes | path, "label": int}`` (SiT; ``label`` also ``class_label``),
* ``{"image" | "video": bytes | path, "caption": str}`` (Wan; a still image is a 1-frame clip),
* precomputed ``{"latents": npy bytes, "label": int}`` or ``{"latents": npy bytes,
  "text_embeds": npy bytes}`` (``lmms-train-precompute`` writes these).

Buckets (``dataset_config.extra``): ``image_buckets`` (``[[H, W], ...]`` pixel sizes; the bucket
of nearest aspect ratio, resized and centre-cropped), ``frame_buckets`` (frame counts; a clip
takes the largest that fits, fewer frames than the smallest is the bad record
``too_few_frames``), ``max_aspect_error`` (``|log(aspect / bucket aspect)|`` beyond it is
``bad_aspect``), ``batch_size`` (samples per batch; a bucket emits when full) and ``video_fps``.
Bad records (corrupt media, too few frames, wrong aspect) are counted or raised by
``bad_record_policy`` like every lmms-data record.

Order and resume: each epoch permutes the row groups (blocks) and the rows inside each block
from ``(seed, epoch)``; rank ``r`` takes every ``dp_world``-th record. The state is the epoch, the
cursor, the records waiting in partly filled buckets (re-read on resume) and the bad-record
counts, so a resumed run yields the same batches. ``noise_seed`` of a sample is a hash of
``(epoch, record index)``: the flow-matching objective's draws replay bit for bit. The state also
holds the files' fingerprint (name and size of each, as ``lmms_data.dataset_fingerprint``): a
resume on a replaced dataset raises ``DatasetChangedError`` instead of reading other records.

Every record-level failure is a bad record named by its file and line (JSONL) or row group and
row (Parquet), never a crash: a record that is not an object, latents or text embeddings that are
not ``.npy`` arrays, a caption that is not valid Unicode, a class label that is not an integer in
``[0, num_classes)`` (``bad_label``; ``num_classes`` comes from the model, e.g. SiT's config).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from lmms_data._config import DatasetConfig
from lmms_data._errors import BadRecordError, BadRecordRatioExceeded, BadRecordStats
from lmms_data._media import decode_video, load_image
from lmms_data._records import check_text

__all__ = ["LatentLoader", "build_latent_loader", "npy_bytes", "npy_load"]

_STATE_VERSION = 1
_DECODE_ERRORS = (ValueError, TypeError, OSError, EOFError)  # np.load on bytes that are not .npy
_MASK = 0x7FFF_FFFF_FFFF_FFFF


def npy_bytes(a: np.ndarray) -> bytes:
    """``np.save`` to bytes (the precompute shards' array encoding)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def npy_load(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)


def _array(value: Any, what: str) -> np.ndarray:
    """A record's ``.npy`` field as float32, or a ``malformed_record`` bad record."""
    try:
        return npy_load(value).astype(np.float32)
    except _DECODE_ERRORS as e:
        raise BadRecordError("malformed_record", f"{what} is not an .npy array: {e}") from None


def _label(value: Any, num_classes: int | None) -> np.int64:
    """A class label: an integer (not a bool) in ``[0, num_classes)``, else ``bad_label``."""
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    if ok and num_classes is not None and not 0 <= int(value) < num_classes:
        ok = False
    if not ok:
        within = f" in [0, {num_classes})" if num_classes is not None else ""
        raise BadRecordError("bad_label", f"class label {value!r} is not an integer{within}")
    return np.int64(value)


def _list_files(path: str) -> list[str]:
    import glob
    import os

    if os.path.isdir(path):
        return sorted(
            f for f in glob.glob(os.path.join(path, "*")) if f.endswith((".parquet", ".jsonl"))
        )
    return sorted(glob.glob(path)) or [path]


def latent_fingerprint(paths: list[str]) -> list[list[list[Any]]]:
    """Per path, ``[name, size]`` of each file (names relative to the path, as
    ``lmms_data.dataset_fingerprint``)."""
    import os

    out = []
    for path in paths:
        files = _list_files(path)
        base = path if os.path.isdir(path) else os.path.dirname(os.path.commonpath(files))
        out.append([[os.path.relpath(f, base), os.path.getsize(f)] for f in files])
    return out


def _mix(x: int) -> int:
    """splitmix64: a well-spread 63-bit seed from a counter."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return (x ^ (x >> 31)) & _MASK


class _Records:
    """Random access to the records of Parquet / JSONL files: ``blocks`` (file, row group or
    line range) with their sizes; reads cache the last Parquet row group."""

    def __init__(self, paths: list[str]) -> None:
        files = [f for p in paths for f in _list_files(p)]
        if not files:
            raise ValueError(f"no .parquet/.jsonl files under {paths}")
        self.blocks: list[tuple[str, int, list[int] | None]] = []  # (file, row group, offsets)
        self.sizes: list[int] = []
        self.lines: list[list[int] | None] = []  # JSONL: the line number of each record
        for f in files:
            if f.endswith(".parquet"):
                meta = pq.ParquetFile(f).metadata
                for g in range(meta.num_row_groups):
                    self.blocks.append((f, g, None))
                    self.sizes.append(meta.row_group(g).num_rows)
                    self.lines.append(None)
            else:
                offsets, lines, pos = [], [], 0
                with open(f, "rb") as fh:
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            offsets.append(pos)
                            lines.append(n)
                        pos += len(line)
                for lo in range(0, len(offsets), 256):  # 256-line blocks
                    self.blocks.append((f, -1, offsets[lo : lo + 256]))
                    self.sizes.append(len(offsets[lo : lo + 256]))
                    self.lines.append(lines[lo : lo + 256])
        self.base = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._cache: tuple[tuple[str, int], list[dict]] | None = None

    def __len__(self) -> int:
        return int(self.base[-1])

    def location(self, index: int) -> str:
        """Where record ``index`` is: ``file line N`` (JSONL) or ``file row group G row R``."""
        b = int(np.searchsorted(self.base, index, side="right") - 1)
        f, g, _ = self.blocks[b]
        row = index - int(self.base[b])
        lines = self.lines[b]
        return f"{f} line {lines[row]}" if lines is not None else f"{f} row group {g} row {row}"

    def read(self, index: int) -> dict[str, Any]:
        b = int(np.searchsorted(self.base, index, side="right") - 1)
        f, g, offsets = self.blocks[b]
        row = index - int(self.base[b])
        if offsets is not None:
            with open(f, "rb") as fh:
                fh.seek(offsets[row])
                line = fh.readline()
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise BadRecordError("malformed_json", f"not JSON: {e}") from None
            if not isinstance(rec, dict):
                raise BadRecordError("malformed_record", f"a {type(rec).__name__}, not an object")
            return rec
        if self._cache is None or self._cache[0] != (f, g):
            self._cache = ((f, g), pq.ParquetFile(f).read_row_group(g).to_pylist())
        return self._cache[1][row]


class LatentLoader:
    """Iterable of latent batches for one DP rank with ``state_dict()`` resume (see module)."""

    def __init__(
        self,
        cfg: DatasetConfig,
        *,
        dp_rank: int = 0,
        dp_world: int = 1,
        tokens_fn: Callable[[tuple[int, ...]], int] | None = None,
        tokenizer: Any = None,
        num_classes: int | None = None,
    ) -> None:
        import os

        ex = dict(cfg.extra)
        self.cfg, self.dp_rank, self.dp_world = cfg, dp_rank, dp_world
        self.batch_size = int(ex.pop("batch_size", 8))
        self.image_buckets = [tuple(b) for b in ex.pop("image_buckets", [[256, 256]])]
        self.frame_buckets = sorted(int(f) for f in ex.pop("frame_buckets", [1]))
        self.max_aspect_error = float(ex.pop("max_aspect_error", 0.3))
        self.video_fps = float(ex.pop("video_fps", 0) or 1e6)  # 0: every frame
        self.text_max_length = int(ex.pop("text_max_length", 64))
        if ex:
            raise ValueError(f"dataset_config.extra: unknown latent-loader keys {sorted(ex)}")
        if self.batch_size < 1 or self.text_max_length < 1 or not self.frame_buckets:
            raise ValueError(  # a batch of 0 samples would never be emitted: a silent stall
                "dataset_config.extra: batch_size and text_max_length must be >= 1 and "
                f"frame_buckets not empty, got {self.batch_size}, {self.text_max_length}, "
                f"{self.frame_buckets}"
            )
        paths = [cfg.dataset_path] if isinstance(cfg.dataset_path, str) else cfg.dataset_path
        self.records = _Records(list(paths))
        self.fingerprint = latent_fingerprint(list(paths))
        self.num_classes = num_classes
        self.data_folder = cfg.data_folder or os.path.dirname(os.path.abspath(
            self.records.blocks[0][0]))  # fmt: skip
        self.tokens_fn = tokens_fn or (lambda shape: int(np.prod(shape[1:])))
        self.tokenizer = tokenizer
        self.epoch, self.cursor = 0, 0
        self.pending: dict[str, list[list[int]]] = {}  # bucket key -> [[index, epoch], ...]
        self._samples: dict[tuple[int, int], dict[str, Any]] = {}  # (index, epoch) -> sample
        self.stats = BadRecordStats()
        self._order: tuple[int, np.ndarray] | None = None

    # ---------------------------------------------------------------- order
    def _my_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            rng = np.random.default_rng([self.cfg.seed, self.epoch, 0x1A7E])
            blocks = np.arange(len(self.records.sizes))
            if self.cfg.shuffle:
                blocks = rng.permutation(blocks)
            parts = []
            for b in blocks:
                lo, n = int(self.records.base[b]), self.records.sizes[b]
                rows = rng.permutation(n) if self.cfg.shuffle else np.arange(n)
                parts.append(lo + rows)
            order = np.concatenate(parts)[self.dp_rank :: self.dp_world]
            if len(order) == 0:
                raise ValueError(f"dp rank {self.dp_rank} of {self.dp_world} got no records")
            self._order = (self.epoch, order)
        return self._order[1]

    # ---------------------------------------------------------------- records -> samples
    def _media(self, src: Any) -> Any:
        import os

        if isinstance(src, dict):  # {"bytes": ..., "path": ...} (HF datasets' image column)
            src = src.get("bytes") or src.get("path")
        if isinstance(src, str) and not os.path.isabs(src):
            src = os.path.join(self.data_folder, src)
        if isinstance(src, str) and not os.path.exists(src):
            raise BadRecordError("missing_media", f"{src} does not exist")
        return src

    def _bucket(self, h: int, w: int) -> tuple[int, int]:
        errs = [abs(math.log((w / h) / (bw / bh))) for bh, bw in self.image_buckets]
        i = int(np.argmin(errs))
        if errs[i] > self.max_aspect_error:
            raise BadRecordError(
                "bad_aspect", f"{w}x{h} is {errs[i]:.2f} (log aspect) from every bucket"
            )
        return self.image_buckets[i]

    def _resize(self, frames: np.ndarray) -> np.ndarray:
        """``[F, H, W, 3] uint8`` -> ``[3, F, bh, bw]`` float32 in [-1, 1] (cover + centre crop)."""
        from PIL import Image

        bh, bw = self._bucket(frames.shape[1], frames.shape[2])
        out = []
        for fr in frames:
            img = Image.fromarray(fr)
            scale = max(bh / img.height, bw / img.width)
            nh, nw = max(bh, round(img.height * scale)), max(bw, round(img.width * scale))
            img = img.resize((nw, nh), Image.BICUBIC)
            top, left = (nh - bh) // 2, (nw - bw) // 2
            out.append(np.asarray(img.crop((left, top, left + bw, top + bh)), dtype=np.float32))
        arr = np.stack(out) / 127.5 - 1.0  # [F, bh, bw, 3]
        return arr.transpose(3, 0, 1, 2)

    def _sample(self, index: int, epoch: int) -> dict[str, Any]:
        rec = self.records.read(index)
        s: dict[str, Any] = {}
        if rec.get("latents") is not None:
            s["latents"] = _array(rec["latents"], "latents")
        elif rec.get("video") is not None:
            clip = decode_video(self._media(rec["video"]), fps=self.video_fps,
                                max_frames=self.frame_buckets[-1], multiple=1)  # fmt: skip
            fits = [f for f in self.frame_buckets if f <= len(clip.frames)]
            if not fits:
                raise BadRecordError(
                    "too_few_frames",
                    f"{len(clip.frames)} frames < the smallest bucket {self.frame_buckets[0]}",
                )
            s["pixel_values"] = self._resize(clip.frames[: fits[-1]])  # [3, F, H, W]
        elif rec.get("image") is not None:
            img = np.asarray(load_image(self._media(rec["image"])))[None]  # [1, H, W, 3]
            px = self._resize(img)
            s["pixel_values"] = px if self.frame_buckets != [1] or "caption" in rec else px[:, 0]
        else:
            raise BadRecordError("malformed_record", "no latents, image or video")
        label = rec.get("label", rec.get("class_label"))
        if label is not None:
            s["class_labels"] = _label(label, self.num_classes)
        if rec.get("text_embeds") is not None:
            s["text_embeds"] = _array(rec["text_embeds"], "text_embeds")  # [L, D]
        elif rec.get("caption") is not None:
            if self.tokenizer is None:
                raise ValueError("caption records need a tokenizer (processor_path) or text_embeds")
            tok = self.tokenizer(check_text(rec["caption"], "caption"), max_length=self.text_max_length,
                                 padding="max_length", truncation=True)  # fmt: skip
            s["input_ids"] = np.asarray(tok["input_ids"], dtype=np.int64)
            s["attention_mask"] = np.asarray(tok["attention_mask"], dtype=np.int64)
        if "class_labels" not in s and "text_embeds" not in s and "input_ids" not in s:
            raise BadRecordError("malformed_record", "no label, caption or text_embeds")
        s["noise_seed"] = np.int64(_mix((epoch << 40) + index))
        return s

    @staticmethod
    def _key(s: dict[str, Any]) -> str:
        return "x".join(map(str, (s.get("latents", s.get("pixel_values"))).shape))

    # ---------------------------------------------------------------- batches
    def _collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
        media = samples[0].get("latents", samples[0].get("pixel_values"))
        per = self.tokens_fn(tuple(media.shape))
        batch["cu_seqlens"] = torch.arange(len(samples) + 1, dtype=torch.int32) * per
        batch["max_seqlen"] = per
        batch["num_samples"] = batch["num_loss_tokens"] = len(samples)
        return batch

    def _next_index(self) -> int | None:
        order = self._my_order()
        if self.cursor >= len(order):
            if self.cfg.num_epochs is not None and self.epoch + 1 >= self.cfg.num_epochs:
                return None
            self.epoch, self.cursor = self.epoch + 1, 0
            order = self._my_order()
        self.cursor += 1
        return int(order[self.cursor - 1])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            index = self._next_index()
            if index is None:
                return
            self.stats.seen += 1
            try:
                sample = self._sample(index, self.epoch)
            except BadRecordError as e:
                e = e.at(self.records.location(index))
                if self.cfg.bad_record_policy == "raise":
                    raise e from None
                self.stats.add(e)
                seen = self.stats.seen
                if seen >= self.cfg.min_records_for_ratio and (
                    self.stats.num_bad > self.cfg.max_bad_record_ratio * seen
                ):
                    raise BadRecordRatioExceeded(
                        f"bad records exceed max_bad_record_ratio={self.cfg.max_bad_record_ratio}"
                        f": {self.stats.summary()}"
                    ) from None
                continue
            key = self._key(sample)
            waiting = self.pending.setdefault(key, [])
            waiting.append([index, self.epoch])
            self._samples[(index, self.epoch)] = sample
            if len(waiting) == self.batch_size:
                del self.pending[key]
                yield self._collate([self._samples.pop((i, e)) for i, e in waiting])

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION, "dp_rank": self.dp_rank, "dp_world": self.dp_world,
            "epoch": self.epoch, "cursor": self.cursor,
            "pending": {k: list(v) for k, v in self.pending.items()},
            "stats": self.stats.to_dict(), "fingerprint": self.fingerprint,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION or (state["dp_rank"], state["dp_world"]) != (
            self.dp_rank,
            self.dp_world,
        ):
            raise ValueError("latent loader state is for another layout: resume with the same one")
        saved = state.get("fingerprint")  # absent in states written before it was recorded
        if saved is not None and saved != self.fingerprint:
            from lmms_data._loader import DatasetChangedError, _fingerprint_changes

            raise DatasetChangedError(_fingerprint_changes(saved, self.fingerprint))
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.stats = BadRecordStats.from_dict(state["stats"])
        self.pending = {k: list(v) for k, v in state["pending"].items()}
        self._samples = {}
        for waiting in self.pending.values():  # re-read the records of partly filled buckets
            for i, epoch in waiting:
                self._samples[(i, epoch)] = self._sample(i, epoch)

    def metrics(self) -> dict[str, int]:
        out = {"records_seen": self.stats.seen, "records_bad": self.stats.num_bad}
        out.update({f"bad/{k}": v for k, v in sorted(self.stats.bad.items())})
        return out


def build_latent_loader(dataset_config: DatasetConfig | dict, **options: Any) -> LatentLoader:
    """Latent batches for one DP rank (see the module docstring); ``options``: those of
    :class:`LatentLoader` (``dp_rank``, ``dp_world``; ``tokens_fn(shape)``: the transformer
    tokens of one sample whose latents/pixels have ``shape`` (FLOPs, throughput); ``tokenizer``;
    ``num_classes``: class labels must lie in ``[0, num_classes)`` (else ``bad_label``))."""
    cfg = (
        DatasetConfig.from_dict(dataset_config)
        if isinstance(dataset_config, dict)
        else dataset_config
    )
    return LatentLoader(cfg, **options)
