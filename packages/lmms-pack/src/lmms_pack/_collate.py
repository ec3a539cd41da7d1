"""Padding-free collation of one pack into one row (numpy), per docs/contracts.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

IGNORE_INDEX = -100
_TOKEN_KEYS = ("input_ids", "labels")


def truncate_sample(sample: Mapping[str, Any], length: int) -> dict[str, Any]:
    """Keep the first ``length`` tokens of a sample dict.

    Cuts ``input_ids``, ``labels`` and ``position_ids`` (last axis, so ``[R, L]`` mRoPE
    positions too) and sets ``length``. Other keys are copied unchanged: media entries are not
    cut, so a multimodal sample whose media tokens would be cut needs its own truncation
    (pass ``truncate_fn`` to :class:`StreamPacker`).
    """
    out = dict(sample)
    for key in (*_TOKEN_KEYS, "position_ids"):
        if key in out and out[key] is not None:
            out[key] = np.asarray(out[key])[..., :length]
    out["length"] = min(int(length), int(np.asarray(sample["input_ids"]).shape[-1]))
    return out


def _sample_arrays(i: int, s: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, Any]:
    try:
        ids, labels = np.asarray(s["input_ids"]), np.asarray(s["labels"])
    except KeyError as e:
        raise KeyError(
            f"sample {i} has no {e.args[0]!r}: samples need input_ids and labels"
        ) from None
    if ids.ndim != 1 or labels.shape != ids.shape or ids.shape[0] == 0:
        raise ValueError(
            f"sample {i}: input_ids and labels must be non-empty 1-D arrays of one length, "
            f"got shapes {ids.shape} and {labels.shape}"
        )
    if "length" in s and int(s["length"]) != ids.shape[0]:
        raise ValueError(
            f"sample {i}: length={s['length']} but input_ids has {ids.shape[0]} tokens"
        )
    pos = s.get("position_ids")
    if pos is not None:
        pos = np.asarray(pos)
        if pos.ndim not in (1, 2) or pos.shape[-1] != ids.shape[0]:
            raise ValueError(
                f"sample {i}: position_ids shape {pos.shape} does not match length {ids.shape[0]}"
            )
    return ids, labels, pos


def collate_packed(
    samples: Sequence[Mapping[str, Any]],
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any]:
    """Concatenate the samples of one pack into one padding-free row (numpy).

    Returns ``input_ids [T]``, ``labels [T]`` (unshifted; the first token of every sample is
    ``ignore_index``, so even a loss that shifts over the whole row never trains a sample's last
    token to predict the next sample's first), ``shift_labels [T]`` (shifted within each sample;
    the last token of every sample and all padding are ``ignore_index``), ``position_ids``
    (``[T]`` restarting at 0 in every sample, or ``[R, T]`` when a sample carries ``[R, L]``
    positions, which are kept as given, floating ones (Qwen3-Omni's fractional TMRoPE times)
    in their dtype; 1-D or missing positions are broadcast to the R rows),
    ``cu_seqlens [n+1]`` int32, ``max_seqlen``, ``num_samples`` and ``num_loss_tokens``.

    ``pad_to_multiple_of`` pads the row to a multiple (sequence-parallel degree, tensor cores):
    the padding is its own last segment in ``cu_seqlens`` with ``pad_token_id`` inputs,
    positions ``0..P-1`` and ignored labels; ``num_samples`` does not count it.

    A sample with ``segments`` (document lengths summing to its length, e.g. a preference
    pair's chosen and rejected documents, which must share a row) is several documents: each is
    its own ``cu_seqlens`` segment, its first label is ignored and default positions restart at
    it; the row then also holds ``sample_segments [n_samples]`` (documents per sample), and
    ``num_samples`` counts documents.

    Keys the collator does not know (media such as ``pixel_values``, ``image_grid_thw``) are
    left to the caller, which concatenates them in pack order (lmms-data does).
    """
    if not samples:
        raise ValueError("collate_packed needs at least one sample")
    parts = [_sample_arrays(i, s) for i, s in enumerate(samples)]
    lens = np.fromiter((p[0].shape[0] for p in parts), dtype=np.int64, count=len(parts))
    docs = _documents(samples, lens)
    n, real = len(docs), int(lens.sum())
    pad = (-real) % pad_to_multiple_of if pad_to_multiple_of else 0
    total = real + pad
    seg_lens = np.append(docs, pad) if pad else docs

    cu_seqlens = np.zeros(len(seg_lens) + 1, dtype=np.int32)
    np.cumsum(seg_lens, out=cu_seqlens[1:])
    starts = cu_seqlens[:-1].astype(np.int64)

    input_ids = np.full(total, pad_token_id, dtype=np.int64)
    input_ids[:real] = np.concatenate([p[0] for p in parts])
    labels = np.full(total, ignore_index, dtype=np.int64)
    labels[:real] = np.concatenate([p[1] for p in parts])
    labels[starts[:n]] = ignore_index  # nothing in the row predicts a sample's first token
    shift_labels = np.full(total, ignore_index, dtype=np.int64)
    shift_labels[:-1] = labels[1:]  # sample ends see the next start (ignored) or padding

    flat = np.arange(total, dtype=np.int64) - np.repeat(starts, seg_lens)
    row = {
        "input_ids": input_ids,
        "labels": labels,
        "shift_labels": shift_labels,
        "position_ids": _positions(parts, lens, flat),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(seg_lens.max()),
        "num_samples": n,
        "num_loss_tokens": int(np.count_nonzero(shift_labels != ignore_index)),
    }
    if any("segments" in s for s in samples):
        row["sample_segments"] = np.asarray(
            [len(s.get("segments") or [0]) for s in samples], dtype=np.int64
        )
    return row


def _positions(
    parts: list[tuple[np.ndarray, np.ndarray, Any]], lens: np.ndarray, flat: np.ndarray
) -> np.ndarray:
    """Row positions: ``flat`` (``[T]``, restarting per segment), tiled to ``[R, T]`` when a
    sample carries ``[R, L]`` positions, then the samples' own positions where given."""
    rows = {p[2].shape[0] for p in parts if p[2] is not None and p[2].ndim == 2}
    if len(rows) > 1:
        raise ValueError(
            f"samples of one pack carry position_ids with different row counts {sorted(rows)}"
        )
    position_ids = np.tile(flat, (rows.pop(), 1)) if rows else flat
    given = [p[2].dtype for p in parts if p[2] is not None]
    if any(np.issubdtype(d, np.floating) for d in given):  # fractional positions kept as given
        position_ids = position_ids.astype(np.result_type(*given))
    sample_starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    for (_, _, pos), a, b in zip(parts, sample_starts, sample_starts + lens):
        if pos is not None:
            position_ids[..., a:b] = pos
    return position_ids


def _documents(samples: Sequence[Mapping[str, Any]], lens: np.ndarray) -> np.ndarray:
    """Document lengths in row order: a sample's ``segments``, or the sample itself."""
    out: list[int] = []
    for i, (s, n) in enumerate(zip(samples, lens)):
        segs = s.get("segments")
        if segs is None:
            out.append(int(n))
            continue
        segs = [int(x) for x in segs]
        if sum(segs) != int(n) or min(segs, default=0) <= 0:
            raise ValueError(f"sample {i}: segments {segs} must be positive and sum to {int(n)}")
        out += segs
    return np.asarray(out, dtype=np.int64)
