"""Every bad-input reason: skipped and counted with its location, or raised with it; ratio abort."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
from PIL import Image

from lmms_data import (
    BadRecordError,
    BadRecordRatioExceeded,
    DatasetConfig,
    SlotStream,
    build_processor,
)
from lmms_data._loader import discover


def _msgs(user, answer="A red circle."):
    out = [{"role": "user", "content": user}]
    if answer is not None:
        out.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return {"messages": out}


def _img(name):
    return [{"type": "image", "image": name}, {"type": "text", "text": "What is it?"}]


GOOD = json.dumps(_msgs(_img("ok.png")))
BAD = {  # reason -> JSONL line
    "malformed_json": '{"messages": [',
    "malformed_record": json.dumps({"text": "no messages here"}),
    "empty_conversation": json.dumps({"messages": [{"role": "user", "content": ""}]}),
    "no_assistant": json.dumps(_msgs(_img("ok.png"), answer=None)),
    "missing_media": json.dumps(_msgs(_img("missing.png"))),
    "bad_image": json.dumps(_msgs(_img("corrupt.png"))),
    "bad_video": json.dumps(_msgs([{"type": "video", "video": "corrupt.mp4"}])),
    "unsupported_media": json.dumps(_msgs([{"type": "audio", "audio": "ok.png"}])),
    "media_mismatch": json.dumps(
        {
            "image": ["ok.png"],
            "conversations": [
                {"from": "human", "value": "<image>\n<image>\nCompare."},
                {"from": "gpt", "value": "Same."},
            ],
        }
    ),
    "too_long": json.dumps(_msgs([{"type": "text", "text": "red " * 400}])),
}


if importlib.util.find_spec("av") is None:  # no video decoder here (e.g. the GPU image)
    del BAD["bad_video"]


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 40, 3), 200, np.uint8)).save(buf, format="PNG")
    (d / "ok.png").write_bytes(buf.getvalue())
    (d / "corrupt.png").write_bytes(buf.getvalue()[:60])  # truncated
    (d / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video")
    lines = []
    for reason in BAD:
        lines += [GOOD, BAD[reason]]
    (d / "data.jsonl").write_text("\n".join([*lines, GOOD]) + "\n")
    return d


def _stream(bad_dir, proc, **kw):
    cfg = DatasetConfig(dataset_path=str(bad_dir / "data.jsonl"), packing_length=128,
                        shuffle=False, num_epochs=1, **kw)  # fmt: skip
    p = build_processor("qwen2_5_vl", proc["path"], cfg)
    return SlotStream(cfg, discover(cfg, 1), p, slot=0, n_slots=1)


def test_skip_counts_every_reason_with_location(bad_dir, proc25):
    s = _stream(bad_dir, proc25, max_bad_record_ratio=0.9)
    batches = list(s)
    assert sum(b["num_samples"] for b in batches) == len(BAD) + 1
    assert s.stats.bad == dict.fromkeys(BAD, 1)
    assert s.stats.seen == 2 * len(BAD) + 1
    for i, reason in enumerate(BAD):  # bad records are on even line numbers 2, 4, ...
        assert any(e.startswith(f"{reason}: ") and f"data.jsonl line {2 * i + 2}:" in e
                   for e in s.stats.examples), reason  # fmt: skip


@pytest.mark.parametrize("reason", list(BAD))
def test_raise_names_reason_and_location(bad_dir, proc25, reason):
    i = list(BAD).index(reason)
    s = _stream(bad_dir, proc25, bad_record_policy="raise")
    with pytest.raises(BadRecordError) as ei:
        list(s)
    assert ei.value.reason == "malformed_json"  # the first bad line comes first ...
    # ... and each reason raises at its exact line when it is the first bad record met
    d = bad_dir / f"only_{reason}"
    d.mkdir(exist_ok=True)
    for f in ("ok.png", "corrupt.png", "corrupt.mp4"):
        (d / f).write_bytes((bad_dir / f).read_bytes())
    (d / "data.jsonl").write_text("\n".join([GOOD, GOOD, BAD[reason], GOOD]) + "\n")
    s = _stream(d, proc25, bad_record_policy="raise")
    with pytest.raises(BadRecordError, match=rf"\[{reason}\].*data.jsonl line 3") as ei:
        list(s)
    assert ei.value.reason == reason and i >= 0


def test_ratio_aborts_with_summary(bad_dir, proc25):
    s = _stream(bad_dir, proc25, max_bad_record_ratio=0.2, min_records_for_ratio=5)
    with pytest.raises(BadRecordRatioExceeded, match=r"max_bad_record_ratio=0\.2.*records bad"):
        list(s)


def test_bad_rank_keeps_yielding(bad_dir, proc25):
    """A slot whose data is half bad still yields every good sample (it never stalls peers)."""
    s = _stream(bad_dir, proc25, max_bad_record_ratio=0.6, min_records_for_ratio=1)
    assert sum(b["num_samples"] for b in s) == len(BAD) + 1


def test_paths_cannot_escape_data_folder(tmp_path, proc25):
    (tmp_path / "sub").mkdir()
    line = json.dumps(_msgs(_img("../secret.png")))
    (tmp_path / "secret.png").write_bytes(b"x")
    (tmp_path / "sub" / "d.jsonl").write_text(line + "\n")
    cfg = DatasetConfig(dataset_path=str(tmp_path / "sub" / "d.jsonl"), bad_record_policy="raise",
                        num_epochs=1)  # fmt: skip
    s = SlotStream(cfg, discover(cfg, 1), build_processor("qwen2_5_vl", proc25["path"], cfg),
                   slot=0, n_slots=1)  # fmt: skip
    with pytest.raises(BadRecordError, match="escapes data_folder"):
        list(s)


@pytest.mark.parametrize(
    ("family", "dataset_type"),
    [("qwen2_5_vl", "chat"), ("qwen3", "chat"), ("text_pretrain", "text")],
)
def test_lone_surrogate_is_a_named_bad_record(tmp_path, proc25, proc3, family, dataset_type):
    """A JSON "\\ud800" escape decodes to a lone surrogate that no tokenizer encodes: a
    malformed_record with its line, for every processor (the check is on the common path)."""
    bad = "hi \ud800 there"
    if dataset_type == "text":
        lines = [json.dumps({"text": "fine words"}), json.dumps({"text": bad})]
    else:
        lines = [json.dumps(_msgs([{"type": "text", "text": "ok?"}])),
                 json.dumps(_msgs([{"type": "text", "text": bad}]))]  # fmt: skip
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    proc = proc25 if family == "qwen2_5_vl" else proc3
    cfg = DatasetConfig(dataset_path=str(tmp_path / "data.jsonl"), dataset_type=dataset_type,
                        packing_length=128, shuffle=False, num_epochs=1,
                        bad_record_policy="raise")  # fmt: skip
    s = SlotStream(cfg, discover(cfg, 1), build_processor(family, proc["path"], cfg), slot=0,
                   n_slots=1)  # fmt: skip
    with pytest.raises(
        BadRecordError, match=r"malformed_record.*lone surrogate.*data.jsonl line 2"
    ):
        list(s)


def test_a_processor_that_fails_on_a_record_gives_a_bad_record(tmp_path):
    """Whatever a processor raises on one record (TypeError, KeyError, ...) is a malformed_record
    with the record's location, not a crash of the rank."""
    (tmp_path / "data.jsonl").write_text(json.dumps(_msgs([{"type": "text", "text": "x"}])) + "\n")
    cfg = DatasetConfig(dataset_path=str(tmp_path / "data.jsonl"), shuffle=False, num_epochs=1)

    def failing(messages):
        raise TypeError("TextEncodeInput must be Union[...]")

    s = SlotStream(cfg, discover(cfg, 1), failing, slot=0, n_slots=1)
    assert list(s) == [] and s.stats.bad == {"malformed_record": 1}
    assert "data.jsonl line 1: the processor failed: TypeError" in s.stats.examples[0]
