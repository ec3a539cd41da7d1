"""Latent batches for diffusion transformers: buckets, bad media, exact resume, DP split."""

from __future__ import annotations

import io
import itertools
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from lmms_data import BadRecordError
from lmms_data._latent import build_latent_loader, npy_bytes
from lmms_data._synthetic_diffusion import generate_synthetic_clips, generate_synthetic_shapes


def _png(w: int, h: int, v: int = 100) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (v, v, v)).save(buf, format="PNG")
    return buf.getvalue()


def _cfg(path: str, **extra) -> dict:
    return {"dataset_path": path, "seed": 3, "min_records_for_ratio": 1000,
            "extra": {"batch_size": 2, **extra}}  # fmt: skip


def test_buckets_never_mix_and_bad_media_is_counted(tmp_path) -> None:
    rows = [{"image": _png(32, 32), "label": 0}, {"image": _png(64, 32), "label": 1},
            {"image": b"not a png", "label": 2}, {"image": _png(40, 40), "label": 3},
            {"image": _png(32, 96), "label": 0}, {"image": _png(70, 34), "label": 1}]  # fmt: skip
    path = str(tmp_path / "mixed.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    loader = build_latent_loader(_cfg(path, image_buckets=[[16, 16], [16, 32]]))
    batches = list(itertools.islice(iter(loader), 4))
    for b in batches:
        px = b["pixel_values"]
        assert px.shape[1:] in ((3, 16, 16), (3, 16, 32)) and px.dtype == torch.float32
        assert float(px.min()) >= -1.0 and float(px.max()) <= 1.0
        assert b["cu_seqlens"].tolist() == [0, px[0, 0].numel(), 2 * px[0, 0].numel()]
        assert b["num_loss_tokens"] == 2 and b["class_labels"].dtype == torch.int64
    m = loader.metrics()
    assert m["bad/bad_image"] >= 1 and m["bad/bad_aspect"] >= 1  # 32x96: 3:1 fits no bucket
    with pytest.raises(BadRecordError, match=r"bad_image|bad_aspect"):
        list(itertools.islice(iter(build_latent_loader(
            {**_cfg(path, image_buckets=[[16, 16], [16, 32]]), "bad_record_policy": "raise"})), 4))  # fmt: skip


def test_resume_replays_batches_and_noise_seeds(tmp_path) -> None:
    path = generate_synthetic_shapes(str(tmp_path), 21, image_size=16, rows_per_group=5)
    cfg = _cfg(path, batch_size=4, image_buckets=[[16, 16]])
    ref = list(itertools.islice(iter(build_latent_loader(cfg)), 12))  # crosses epochs (21 rows)
    first = build_latent_loader(cfg)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    resumed = build_latent_loader(cfg)
    resumed.load_state_dict(state)
    for want, got in zip(ref[5:], itertools.islice(iter(resumed), 7), strict=True):
        for k in ("pixel_values", "class_labels", "noise_seed"):
            assert torch.equal(want[k], got[k]), k
    seeds = torch.cat([b["noise_seed"] for b in ref])
    assert len(set(seeds.tolist())) == len(seeds)  # a record seen again in a new epoch: new noise


def test_dp_ranks_split_records(tmp_path) -> None:
    path = generate_synthetic_shapes(str(tmp_path), 16, image_size=16)
    cfg = _cfg(path, image_buckets=[[16, 16]])
    seen = []
    for r in range(2):
        loader = build_latent_loader({**cfg, "num_epochs": 1}, dp_rank=r, dp_world=2)
        seen.append({int(s) for b in loader for s in b["noise_seed"]})
    assert len(seen[0]) == len(seen[1]) == 8 and not seen[0] & seen[1]


def test_precomputed_latents_and_text(tmp_path) -> None:
    rows = [{"latents": npy_bytes(np.full((4, 2, 4, 4), i, np.float32)),
             "text_embeds": npy_bytes(np.ones((6, 8), np.float32) * i)} for i in range(4)]  # fmt: skip
    path = str(tmp_path / "pre.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "pre.parquet"))
    b = next(iter(build_latent_loader(_cfg(str(tmp_path / "pre.parquet")), tokens_fn=lambda s: 7)))
    assert b["latents"].shape == (2, 4, 2, 4, 4) and b["text_embeds"].shape == (2, 6, 8)
    assert b["cu_seqlens"].tolist() == [0, 7, 14]
    assert not os.path.exists(path)


def test_clips_frame_buckets_and_too_few_frames(tmp_path) -> None:
    pytest.importorskip("av")
    generate_synthetic_clips(str(tmp_path), 4, size=16, frames=7)
    path = str(tmp_path / "clips.parquet")

    def tok(text, **kw):
        ids = [len(w) for w in text.split()][: kw["max_length"]]
        pad = kw["max_length"] - len(ids)
        return {"input_ids": ids + [0] * pad, "attention_mask": [1] * len(ids) + [0] * pad}

    cfg = _cfg(path, image_buckets=[[16, 16]], frame_buckets=[5, 9], text_max_length=8)
    b = next(iter(build_latent_loader(cfg, tokenizer=tok)))
    assert b["pixel_values"].shape == (2, 3, 5, 16, 16)  # 7 frames: the 5-frame bucket
    assert b["input_ids"].shape == (2, 8) and int(b["attention_mask"][0].sum()) == 5
    short = build_latent_loader({**_cfg(path, image_buckets=[[16, 16]], frame_buckets=[9]),
                                 "num_epochs": 1}, tokenizer=tok)  # fmt: skip
    assert list(short) == [] and short.metrics()["bad/too_few_frames"] == 4


def test_bad_labels_latents_and_lines_are_named_bad_records(tmp_path) -> None:
    """Labels that are not an integer in [0, num_classes), latents that are not .npy, a line
    that is not an object: each a bad record named by file and line, never a crash."""
    good = npy_bytes(np.zeros((4, 2, 2), np.float32))
    cfg = {**_cfg(str(tmp_path / "labels.parquet")), "shuffle": False, "num_epochs": 1}
    mixed = [{"latents": good, "label": v} for v in (0, 99, -1, 3, 1)] + [
        {"latents": b"junk", "label": 1}
    ]
    pq.write_table(pa.Table.from_pylist(mixed), tmp_path / "labels.parquet")
    loader = build_latent_loader(cfg, num_classes=4)
    got = [int(x) for b in loader for x in b["class_labels"]]
    assert got == [0, 3]  # 1 waits alone in its bucket at the end (batch_size 2): not yielded
    m = loader.metrics()
    assert m["bad/bad_label"] == 2 and m["bad/malformed_record"] == 1, m
    with pytest.raises(BadRecordError, match=r"bad_label.*99.*labels\.parquet row group 0 row 1"):
        list(build_latent_loader({**cfg, "bad_record_policy": "raise"}, num_classes=4))
    # a JSONL file: a string label and a line that is not an object, named by line number
    (tmp_path / "a.png").write_bytes(_png(16, 16))
    path = tmp_path / "j.jsonl"
    path.write_text('{"image": "a.png", "label": "cat"}\n\n5\n{"image": "a.png", "label": true}\n')
    cfg = {**_cfg(str(path), image_buckets=[[16, 16]]), "shuffle": False, "num_epochs": 1}
    with pytest.raises(BadRecordError, match=r"bad_label.*'cat'.*j\.jsonl line 1"):
        list(build_latent_loader({**cfg, "bad_record_policy": "raise"}))
    loader = build_latent_loader(cfg)
    assert list(loader) == [] and loader.metrics()["records_bad"] == 3
    assert any("j.jsonl line 3" in e for e in loader.stats.examples)  # the line "5"


def test_replaced_dataset_does_not_resume_silently(tmp_path) -> None:
    from lmms_data import DatasetChangedError

    path = generate_synthetic_shapes(str(tmp_path), 12, image_size=16, rows_per_group=4)
    cfg = _cfg(path, batch_size=2, image_buckets=[[16, 16]])
    a = build_latent_loader(cfg)
    next(iter(a))
    state = a.state_dict()
    generate_synthetic_shapes(str(tmp_path), 20, image_size=16, rows_per_group=4)  # replaced
    with pytest.raises(DatasetChangedError, match="bytes"):
        build_latent_loader(cfg).load_state_dict(state)


def test_a_batch_of_zero_samples_is_refused(tmp_path) -> None:
    """extra.batch_size: 0 would never emit a batch (a loop at 100% CPU): refused at build."""
    path = generate_synthetic_shapes(str(tmp_path), 4, image_size=16, rows_per_group=4)
    with pytest.raises(ValueError, match="batch_size and text_max_length must be >= 1"):
        build_latent_loader(_cfg(path, batch_size=0, image_buckets=[[16, 16]]))
