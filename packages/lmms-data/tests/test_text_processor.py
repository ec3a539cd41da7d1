"""Text-only processor of the text families (qwen2, qwen2_5, qwen3): labels, lengths, bad records,
the tokenizer-only local folder, synthetic text data and packing through the loader."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import lmms_data as ld
from lmms_data import IGNORE_INDEX, BadRecordError


@pytest.fixture(scope="module")
def text_proc(tmp_path_factory) -> dict:
    return ld.build_local_processor(str(tmp_path_factory.mktemp("proc_text")), "qwen2_5")


def _chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in turns]


def test_one_class_registered_for_every_text_family():
    # the trainer's tests check these are the families the text model specs declare
    assert ld.TEXT_FAMILIES == ("qwen2", "qwen2_5", "qwen3")
    for fam in ld.TEXT_FAMILIES:
        assert ld.PROCESSOR_REGISTRY.get(fam) is ld.QwenTextProcessor, fam


def test_labels_only_on_assistant_turns_and_lengths(text_proc):
    from transformers import AutoTokenizer

    path = text_proc["path"]
    tok = AutoTokenizer.from_pretrained(path)  # the local folder loads as a plain tokenizer
    assert tok.convert_tokens_to_ids("<|im_end|>") == text_proc["eos_token_id"]
    assert set(ld.SPECIAL_TOKENS) <= set(tok.get_vocab())
    proc = ld.build_processor("qwen2_5", path)
    msgs = _chat(("system", "Be brief."), ("user", "What is 2 + 3?"), ("assistant", "2 + 3 = 5."),
                 ("user", "Repeat: red"), ("assistant", "red"))  # fmt: skip
    s = proc(msgs)
    ids, labels = s["input_ids"], s["labels"]
    assert s["length"] == len(ids) == len(labels)
    np.testing.assert_array_equal(s["position_ids"], np.arange(len(ids)))
    text = tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"][0]["text"]} for m in msgs], tokenize=False
    )
    assert tok.decode(ids) == text  # the tokenizer's own template, token for token
    sup = labels != IGNORE_INDEX
    np.testing.assert_array_equal(labels[sup], ids[sup])
    spans = np.flatnonzero(np.diff(np.r_[0, sup.astype(int), 0]))  # start/end of each span
    got = [tok.decode(ids[a:b]) for a, b in zip(spans[::2], spans[1::2], strict=True)]
    assert got == ["2 + 3 = 5.<|im_end|>", "red<|im_end|>"]
    # string content, several text parts and a list of parts render the same
    same = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                         {"type": "text", "text": "2 + 3?"}]},
            {"role": "assistant", "content": "2 + 3 = 5."}]  # fmt: skip
    a = proc(ld.normalise({"messages": same}))
    b = proc(_chat(("user", "What is 2 + 3?"), ("assistant", "2 + 3 = 5.")))
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_bad_records(text_proc):
    proc = ld.build_processor("qwen3", text_proc["path"])
    img = [{"role": "user", "content": [{"type": "image", "image": b"x"},
                                        {"type": "text", "text": "hi"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]  # fmt: skip
    with pytest.raises(BadRecordError) as e:
        proc(img)
    assert e.value.reason == "unsupported_media"
    with pytest.raises(BadRecordError) as e:
        proc(_chat(("user", "hi")))
    assert e.value.reason == "no_assistant"
    with pytest.raises(TypeError, match="unknown option"):
        ld.build_processor("qwen3", text_proc["path"], tokenz_per_second=1)


def _media_records(path) -> None:
    recs = [{"messages": _chat(("user", f"Repeat: {i}"), ("assistant", f"{i}"))} for i in range(8)]
    for i in (2, 5):  # an image path that does not exist: rejected before any media lookup
        recs[i]["messages"][0]["content"].insert(0, {"type": "image", "image": "none.png"})
    recs[6]["messages"][0]["content"].insert(0, {"type": "video", "video": "clip.mp4"})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_media_records_counted_or_raised(text_proc, tmp_path):
    _media_records(tmp_path / "mixed.jsonl")
    base = dict(dataset_path=str(tmp_path / "mixed.jsonl"), processor_family="qwen2",
                processor_path=text_proc["path"], packing_length=64, num_workers=0,
                num_epochs=1, shuffle=False)  # fmt: skip
    loader = ld.build_dataloader(ld.DatasetConfig(**base), None)
    n = sum(int(b["num_samples"]) for b in loader)
    m = loader.metrics()
    assert (n, m["records_seen"], m["bad/unsupported_media"]) == (5, 8, 3), m
    cfg = ld.DatasetConfig(**base, bad_record_policy="raise")
    with pytest.raises(BadRecordError, match=r"\[unsupported_media\].*mixed.jsonl"):
        list(ld.build_dataloader(cfg, None))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_synthetic_text_packs_through_the_loader(text_proc, tmp_path, fmt):
    paths = ld.generate_synthetic_text(str(tmp_path / "d"), 40, fmt, seed=3)
    again = ld.generate_synthetic_text(str(tmp_path / "e"), 40, fmt, seed=3)
    assert Path(paths[0]).read_bytes() == Path(again[0]).read_bytes()  # deterministic
    cfg = ld.DatasetConfig(dataset_path=str(tmp_path / "d"), processor_family="qwen3",
                           processor_path=text_proc["path"], packing_length=128, num_workers=0,
                           num_epochs=1)  # fmt: skip
    loader = ld.build_dataloader(cfg, None)
    batches = list(loader)
    assert sum(int(b["num_samples"]) for b in batches) == 40
    assert loader.metrics()["records_bad"] == 0
    for b in batches:
        T = b["input_ids"].shape[0]
        assert T <= 128 and b["position_ids"].shape == (T,)
        cu = b["cu_seqlens"].tolist()
        for a, e in itertools.pairwise(cu):  # positions restart in every sample
            assert b["position_ids"][a:e].tolist() == list(range(e - a))
        assert b["num_loss_tokens"] > 0 and "pixel_values" not in b


def test_llama3_chat_format_labels_the_answers(text_proc, tmp_path):
    """A tokenizer with a LLaMA-3-format chat template (LLaDA-8B-Instruct's): the answers and their
    closing <|eot_id|> are the labels, headers and user turns are not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_proc["path"])
    tok.add_special_tokens({"additional_special_tokens": [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})  # fmt: skip
    tok.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    tok.save_pretrained(tmp_path / "llama3")
    proc = ld.build_processor("qwen2", str(tmp_path / "llama3"))
    out = proc(_chat(("user", "What is 2 plus 3?"), ("assistant", "5"),
                     ("user", "And 1 plus 1?"), ("assistant", "2")))  # fmt: skip
    ids, labels = out["input_ids"], out["labels"]
    sup = labels != IGNORE_INDEX
    assert tok.decode(ids[sup]) == "5<|eot_id|>2<|eot_id|>"
    assert (labels[sup] == ids[sup]).all()
    with pytest.raises(BadRecordError):
        proc(_chat(("user", "only a question")))
