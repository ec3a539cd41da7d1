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


def _long_corpus(proc, tmp_path, packing_length=32):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(proc["path"])
    docs = [" ".join(f"w{i}x{j}" for j in range(n)) for i, n in enumerate((70, 5, 130, 12, 40))]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = ld.DatasetConfig(dataset_path=str(path), dataset_type="text",
                           processor_family="text_pretrain", processor_path=proc["path"],
                           packing_length=packing_length, num_workers=0, num_epochs=1,
                           shuffle=False, max_open_bins=2)  # fmt: skip
    ids = [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs]
    return cfg, ids


def test_long_documents_are_split_not_dropped(proc, tmp_path):
    """A document longer than packing_length becomes consecutive chunks of packing_length
    tokens (the last shorter), each its own segment with positions from 0; nothing is dropped
    and no record is bad."""
    cfg, docs = _long_corpus(proc, tmp_path)
    assert max(len(d) for d in docs) > 3 * cfg.packing_length  # several cuts per document
    loader = ld.build_dataloader(cfg, None)
    segments = []
    for b in loader:
        cu = b["cu_seqlens"].tolist()
        for k in range(int(b["num_samples"])):
            seg = b["input_ids"][cu[k] : cu[k + 1]].tolist()
            assert b["position_ids"].reshape(-1)[cu[k] : cu[k + 1]].tolist() == list(
                range(len(seg))
            )
            assert b["labels"][cu[k] + 1 : cu[k + 1]].tolist() == seg[1:]  # collate: first -100
            assert 1 <= len(seg) <= cfg.packing_length
            segments.append(seg)
    assert loader.metrics()["records_bad"] == 0
    chunks = [
        d[i : i + cfg.packing_length] for d in docs for i in range(0, len(d), cfg.packing_length)
    ]
    assert sorted(segments) == sorted(chunks)  # every token, each chunk exactly once


def test_resume_inside_a_split_document_is_exact(proc, tmp_path):
    """A state saved while some chunks of a document are not yet packed resumes them."""
    import torch

    cfg, _ = _long_corpus(proc, tmp_path)
    mk = lambda: ld.build_dataloader(cfg, None)  # noqa: E731
    ref = list(mk())
    for k in range(1, len(ref)):
        a = mk()
        it = iter(a)
        head = [next(it) for _ in range(k)]
        b = mk()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        got = head + list(b)
        assert len(got) == len(ref), k
        for x, y in zip(got, ref, strict=True):
            assert torch.equal(x["input_ids"], y["input_ids"]), k


def test_local_processor_folder_for_text_pretrain(tmp_path):
    info = ld.build_local_processor(str(tmp_path / "p"), "text_pretrain")
    p = ld.build_processor("text_pretrain", info["path"])
    s = p([{"role": "assistant", "content": [{"type": "text", "text": "a b"}]}])
    assert int(s["input_ids"][-1]) == info["eos_token_id"]


def test_a_slot_state_from_before_split_documents_still_resumes(proc, tmp_path):
    """A version-1 slot state (written before chunks existed: items [*ref, length]) loads as
    version 2 (every item chunk 0, nothing pending) and continues exactly."""
    import copy

    import torch

    cfg, docs = _long_corpus(proc, tmp_path, packing_length=700)
    assert max(len(d) for d in docs) <= 700  # nothing is split
    mk = lambda: ld.build_dataloader(cfg, None)  # noqa: E731
    ref = list(mk())
    assert len(ref) >= 2
    a = mk()
    it = iter(a)
    head = [next(it)]
    state = copy.deepcopy(a.state_dict())
    for w in state["workers"].values():  # the same position, written by the old code
        assert w["pending"] == [] and all(
            i[4] == 0 for b in w["packer"]["bins"] for i in b["items"]
        )
        w["version"] = 1
        del w["pending"]
        for b in w["packer"]["bins"]:
            b["items"] = [[*i[:4], *i[5:]] for i in b["items"]]
    b = mk()
    b.load_state_dict(state)
    got = head + list(b)
    assert [x["input_ids"].tolist() for x in got] == [y["input_ids"].tolist() for y in ref]
    assert all(torch.equal(x["cu_seqlens"], y["cu_seqlens"]) for x, y in zip(got, ref, strict=True))
