"""Files users hold: one-JSON-array files (LLaVA / ShareGPT) streamed with exact resume, OpenAI-style
content parts, and one line naming the accepted shapes for anything else."""

from __future__ import annotations

import base64
import io
import itertools
import json
import tracemalloc

import numpy as np
import pytest
import torch
from lmms_data_testutil import batch_ids, id_processor, id_record, ids_over_ranks
from PIL import Image

from lmms_data import DatasetConfig, build_dataloader, build_processor, discover_units, iter_unit
from lmms_data._json_array import iter_array, sniff
from lmms_data._loader import discover
from lmms_data._readers import decode_raw
from lmms_data._records import normalise, resolve_media
from lmms_data._shape import DataShapeError
from lmms_data._stream import SlotStream


def _png(value: int = 200) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 40, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _llava(i: int) -> dict:
    return {
        "id": f"r{i}",
        "image": "img.png",
        "conversations": [
            {"from": "human", "value": f"<image>\nWhat is shape {i}? ünï \u4e2d"},
            {"from": "gpt", "value": f'Shape {i}, "quoted" \\ [x], {{y}}.'},
        ],
    }


def test_array_elements_offsets_and_resume(tmp_path):
    recs = [_llava(i) for i in range(50)]
    for indent in (None, 4):
        path = tmp_path / f"a{indent}.json"
        path.write_text("\ufeff" + json.dumps(recs, indent=indent, ensure_ascii=False))
        assert sniff(str(path)) == "json_array"
        items = list(iter_array(str(path), 0, path.stat().st_size))
        assert [json.loads(raw) for _, _, raw in items] == recs  # UTF-8 kept byte for byte
        # each item's next position is the next item's start; resuming there is exact
        assert [q for _, q, _ in items[:-1]] == [p for p, _, _ in items[1:]]
        rest = list(iter_array(str(path), 0, path.stat().st_size, items[17][1]))
        assert rest == items[18:]
        assert list(iter_array(str(path), 0, path.stat().st_size, items[-1][1])) == []
        # split into byte ranges at element starts: every element once, in order, indexed
        units = discover_units(str(path), None, 4)
        assert len(units) == 4 and units[0].fmt == "json_array"
        got = [(u.base + k, raw) for u in units for k, (_, _, raw) in enumerate(iter_unit(u))]
        assert got == [(k, raw) for k, (_, _, raw) in enumerate(items)]


def test_large_array_streams_in_bounded_memory(tmp_path):
    path = tmp_path / "big.json"
    text = "x" * 2000
    with open(path, "w") as f:  # ~24 MB
        json.dump(
            [{"messages": [{"role": "user", "content": text}], "n": i} for i in range(12000)], f
        )
    tracemalloc.start()
    it = iter_unit(discover_units(str(path), None, 1)[0])
    firsts = [json.loads(raw)["n"] for _, _, raw in itertools.islice(it, 200)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert firsts == list(range(200))
    assert peak < 6 << 20, f"peak {peak / 2**20:.1f} MiB: the file must not be loaded whole"


def test_json_array_loader_resume_is_exact(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([id_record(i) for i in range(300)], indent=1))
    cfg = DatasetConfig(dataset_path=str(path), packing_length=24, max_open_bins=4,
                        shuffle_buffer=16, seed=5)  # fmt: skip
    mk = lambda: build_dataloader(cfg, id_processor, dp_rank=1, dp_world=2, num_workers=0)  # noqa: E731
    ref = [batch_ids(b) for b in itertools.islice(iter(mk()), 40)]
    a = mk()
    first = [batch_ids(b) for b in itertools.islice(iter(a), 15)]
    b = mk()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    second = [batch_ids(x) for x in itertools.islice(iter(b), 25)]
    assert first + second == ref
    # two ranks cover the array exactly once in one epoch
    cfg1 = DatasetConfig(dataset_path=str(path), packing_length=24, num_epochs=1, shuffle_buffer=8)
    assert sorted(ids_over_ranks(cfg1, 2, num_workers=0)) == list(range(300))


def test_broken_array_is_one_bad_record_then_stops(tmp_path):
    good = [json.dumps(id_record(i)) for i in range(3)]
    path = tmp_path / "broken.json"
    path.write_text("[" + ",".join(good) + ', {"messages": [}, ' + good[0] + "]")
    cfg = DatasetConfig(dataset_path=str(path), packing=False, num_epochs=1, shuffle=False)
    s = SlotStream(cfg, discover(cfg, 1), id_processor, slot=0, n_slots=1)
    assert [batch_ids(b)[0] for b in s] == [0, 1, 2]
    assert s.stats.bad == {"malformed_json": 1}
    assert "broken.json record 3 (@byte" in s.stats.examples[0]
    assert "the rest of the array is skipped" in s.stats.examples[0]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{\n  "data": [1, 2]\n}', "one JSON object spread over several lines"),
        ('"just a string"', "starts with"),
    ],
)
def test_unrecognised_file_names_accepted_shapes(tmp_path, content, match):
    (tmp_path / "x.json").write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        discover_units(str(tmp_path / "x.json"), None, 1)
    assert "JSON Lines" in str(e.value) and "one JSON array" in str(e.value)
    assert "\n" not in str(e.value)


def test_unrecognised_records_fail_at_start_with_one_line(tmp_path):
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "a", "output": "b"}] * 3))
    cfg = DatasetConfig(dataset_path=str(tmp_path / "alpaca.json"))
    with pytest.raises(DataShapeError) as e:
        build_dataloader(cfg, id_processor, num_workers=0)
    msg = str(e.value)
    assert "['instruction', 'output']" in msg and '"messages"' in msg and "conversations" in msg
    assert "\n" not in msg


def test_openai_content_parts_map_to_media(tmp_path):
    png = _png()
    (tmp_path / "a.png").write_bytes(png)
    wav = b"RIFF....WAVEfmt fake"
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    rec = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "input_text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": data_url, "detail": "low"}},
                {"type": "image_url", "image_url": {"url": "a.png"}},
                {"type": "input_image", "image_url": "file://a.png"},
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                        "format": "wav"}},
            ]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Same."}]},
        ]
    }  # fmt: skip
    msgs = normalise(rec)
    assert msgs[0]["role"] == "system"
    parts = msgs[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "image", "image", "audio"]
    base = str(tmp_path)
    got = [resolve_media(p[p["type"]], p["type"], base, allow_absolute=False) for p in parts[1:]]
    assert got[0] == png and got[1] == got[2] == str((tmp_path / "a.png").resolve())
    assert got[3] == wav
    for value, reason in (("https://example.com/a.png", "remote URL"),
                          ("data:image/png;base64,@@@", "not valid base64")):  # fmt: skip
        with pytest.raises(ValueError, match=reason):
            resolve_media(value, "image", base, allow_absolute=False)


def test_llava_and_openai_arrays_through_the_vl_processor(tmp_path, proc25):
    (tmp_path / "img.png").write_bytes(_png(90))
    data_url = "data:image/png;base64," + base64.b64encode(_png(90)).decode()
    openai = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                     {"type": "text", "text": "What is shape 0? ünï \u4e2d"}]},
        {"role": "assistant", "content": 'Shape 0, "quoted" \\ [x], {y}.'}]}  # fmt: skip
    (tmp_path / "llava.json").write_text(json.dumps([_llava(0)], indent=2))
    (tmp_path / "openai.json").write_text(json.dumps([openai]))
    samples = []
    for name in ("llava.json", "openai.json"):
        cfg = DatasetConfig(dataset_path=str(tmp_path / name), packing=False, num_epochs=1,
                            bad_record_policy="raise")  # fmt: skip
        proc = build_processor("qwen2_5_vl", proc25["path"], cfg)
        s = SlotStream(cfg, discover(cfg, 1), proc, slot=0, n_slots=1, as_torch=True)
        samples += list(s)
    a, b = samples
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert torch.equal(a["pixel_values"], b["pixel_values"])  # the same image, path vs data URL
    u = discover_units(str(tmp_path / "llava.json"), None, 1)[0]
    p, _, raw = next(iter_unit(u))
    assert decode_raw(u, p, 0, raw)["id"] == "r0"


def test_sharegpt_array_through_the_text_processor(tmp_path):
    from lmms_data import build_local_processor

    proc = build_local_processor(str(tmp_path / "proc"), "qwen2_5")
    recs = [{"id": i, "conversations": [
        {"from": "system", "value": "Answer briefly."},
        {"from": "human", "value": f"What is {i} + 1?"},
        {"from": "gpt", "value": f"{i + 1}."},
        {"from": "human", "value": "And doubled?"},
        {"from": "gpt", "value": f"{2 * (i + 1)}."}]} for i in range(4)]  # fmt: skip
    (tmp_path / "sharegpt.json").write_text(json.dumps(recs, indent=2))
    cfg = DatasetConfig(dataset_path=str(tmp_path / "sharegpt.json"), processor_family="qwen2_5",
                        packing=False, num_epochs=1, shuffle=False, bad_record_policy="raise")  # fmt: skip
    p = build_processor("qwen2_5", proc["path"], cfg)
    batches = list(SlotStream(cfg, discover(cfg, 1), p, slot=0, n_slots=1, as_torch=False))
    assert len(batches) == 4
    tok = p.tokenizer
    for i, b in enumerate(batches):
        sup = b["labels"][b["labels"] != -100]
        text = tok.decode(sup)  # both assistant turns supervised, nothing else
        assert text == f"{i + 1}.<|im_end|>{2 * (i + 1)}.<|im_end|>", text


def test_input_audio_part_through_the_audio_processor(tmp_path):
    """An OpenAI `input_audio` part (base64 WAV) becomes audio features and audio tokens."""
    import wave

    pytest.importorskip("soundfile")
    from lmms_data import build_local_processor

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.sin(np.arange(16000) * 0.05) * 8000).astype(np.int16).tobytes())
    audio = {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}
    rec = {"messages": [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": audio},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A tone."}]}  # fmt: skip
    (tmp_path / "audio.json").write_text(json.dumps([rec]))
    info = build_local_processor(str(tmp_path / "proc"), "qwen2_audio")
    cfg = DatasetConfig(dataset_path=str(tmp_path / "audio.json"), packing=False, num_epochs=1,
                        bad_record_policy="raise")  # fmt: skip
    proc = build_processor("qwen2_audio", info["path"], cfg)
    (b,) = list(SlotStream(cfg, discover(cfg, 1), proc, slot=0, n_slots=1, as_torch=False))
    assert b["input_features"].shape[-1] == 128 and int(np.asarray(b["audio_frames"]).sum()) > 0
