"""Plain-text pretraining: ``{"text": ...}`` records (dataset type ``text``) through the
``text_pretrain`` processor (no chat template, every token supervised, EOS at the end) and the
packed loader; records without text and media parts are bad records."""

from __future__ import annotations

import json

import pytest

import lmms_data as ld
from lmms_data import BadRecordError


@pytest.fixture(scope="module")
def proc(tmp_path_factory) -> dict:
    return ld.build_local_processor(str(tmp_path_factory.mktemp("proc_pretrain")), "qwen3")


def test_document_tokens_all_supervised_and_eos(proc):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(proc["path"])
    p = ld.build_processor("text_pretrain", proc["path"])
    rec = ld.DATASET_REGISTRY.get("text")({"text": "one two three"})
    s = p(rec["messages"])
    expected = tok("one two three", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert s["input_ids"].tolist() == expected and s["labels"].tolist() == expected
    assert s["length"] == len(expected) and s["position_ids"].tolist() == list(range(len(expected)))
    assert "<|im_start|>" not in tok.decode(s["input_ids"])  # no chat template
    cut = ld.build_processor("text_pretrain", proc["path"], max_tokens=3)(rec["messages"])
    assert cut["input_ids"].tolist() == [*expected[:2], tok.eos_token_id]
    with pytest.raises(BadRecordError, match="string 'text'"):
        ld.DATASET_REGISTRY.get("text")({"body": "x"})
    with pytest.raises(BadRecordError):
        p([{"role": "user", "content": [{"type": "image", "image": "a.png"}]}])
    with pytest.raises(BadRecordError):
        p([{"role": "assistant", "content": [{"type": "text", "text": "  "}]}])


def test_text_corpus_packs_through_the_loader(proc, tmp_path):
    docs = [" ".join(["word"] * n) for n in (3, 40, 1, 17, 9, 25)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + '{"text": 5}\n')
    cfg = ld.DatasetConfig(dataset_path=str(path), dataset_type="text",
                           processor_family="text_pretrain", processor_path=proc["path"],
                           packing_length=256, num_workers=0, num_epochs=1)  # fmt: skip
    loader = ld.build_dataloader(cfg, None)
    batches = list(loader)
    assert sum(int(b["num_samples"]) for b in batches) == len(docs)
    assert loader.metrics()["records_bad"] == 1  # the record whose text is not a string
    for b in batches:
        cu = b["cu_seqlens"].tolist()
        for e in cu[1 : int(b["num_samples"]) + 1]:
            assert int(b["input_ids"][e - 1]) == proc["eos_token_id"]  # each document ends in EOS


def test_local_processor_folder_for_text_pretrain(tmp_path):
    info = ld.build_local_processor(str(tmp_path / "p"), "text_pretrain")
    p = ld.build_processor("text_pretrain", info["path"])
    s = p([{"role": "assistant", "content": [{"type": "text", "text": "a b"}]}])
    assert int(s["input_ids"][-1]) == info["eos_token_id"]
