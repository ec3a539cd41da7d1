"""``dataset_type: preference``: the common preference layouts become one sample of two documents
(chosen, rejected) that share the prompt and its media, packed into one row."""

from __future__ import annotations

import json

import numpy as np
import pytest

import lmms_data as ld
from lmms_data._errors import BadRecordError
from lmms_data._preference import preference
from lmms_data._records import normalise


def _texts(rec):
    return [(m["role"], [p.get("text", p["type"]) for p in m["content"]]) for m in normalise(rec)]


def test_layouts_give_two_chat_records_sharing_the_prompt():
    img = b"png-bytes"
    # prompt/chosen/rejected strings, the image column before the prompt's text
    c, r = preference({"prompt": "What is it?", "chosen": "A cat.", "rejected": "A dog.",
                       "images": [img]})["pair"]  # fmt: skip
    assert _texts(c) == [("user", ["image", "What is it?"]), ("assistant", ["A cat."])]
    assert (
        _texts(r)[-1] == ("assistant", ["A dog."]) and normalise(r)[0]["content"][0]["image"] == img
    )
    # a <image> tag places the image
    c, _ = preference({"prompt": "Look: <image> what?", "chosen": "x", "rejected": "y",
                       "images": [img]})["pair"]  # fmt: skip
    assert _texts(c)[0] == ("user", ["Look: ", "image", " what?"])
    # message lists (as JSON strings, as Parquet stores them)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    c, r = preference({"prompt": json.dumps(prompt),
                       "chosen": [{"role": "assistant", "content": "Hello."}],
                       "rejected": json.dumps([{"role": "assistant", "content": "Go away."}])})["pair"]  # fmt: skip
    assert [m["role"] for m in normalise(c)] == ["system", "user", "assistant"]
    assert _texts(r)[-1] == ("assistant", ["Go away."])
    # two whole conversations: the shared leading turns are the prompt
    user = {"role": "user", "content": "2+2?"}
    c, r = preference({"chosen": [user, {"role": "assistant", "content": "4"}],
                       "rejected": [user, {"role": "assistant", "content": "5"}]})["pair"]  # fmt: skip
    assert _texts(c) == [("user", ["2+2?"]), ("assistant", ["4"])]
    assert _texts(r) == [("user", ["2+2?"]), ("assistant", ["5"])]
    # precomputed reference log-probabilities ride along, chosen first
    out = preference({"prompt": "q", "chosen": "a", "rejected": "b", "ref_chosen_logps": -3.5,
                      "ref_rejected_logps": -4})  # fmt: skip
    assert out["ref_logps"] == [-3.5, -4.0]
    with pytest.raises(BadRecordError, match="both be numbers"):
        preference({"prompt": "q", "chosen": "a", "rejected": "b", "ref_chosen_logps": 1.0})
    with pytest.raises(BadRecordError, match="chosen"):
        preference({"prompt": "q", "chosen": "a"})
    with pytest.raises(BadRecordError, match="no assistant"):
        preference({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"})


def test_pairs_pack_as_two_documents_with_their_media(tmp_path, proc25):
    ld.generate_synthetic_preference(str(tmp_path), 12, seed=0)
    cfg = ld.DatasetConfig(dataset_path=str(tmp_path), dataset_type="preference", packing=True,
                           packing_length=512, max_pixels=12544)  # fmt: skip
    proc = ld.build_processor("qwen2_5_vl", proc25["path"], cfg)
    batch = next(iter(ld.build_dataloader(cfg, proc)))
    segs = batch["sample_segments"]
    assert segs.tolist() == [2] * len(segs) and len(segs) >= 2
    cu = batch["cu_seqlens"].tolist()
    assert (
        batch["num_samples"]
        == 2 * len(segs)
        == len(cu) - 1 - (cu[-1] != batch["input_ids"].numel())
    )
    tok = proc.tokenizer
    ids, labels = batch["input_ids"], batch["labels"]
    for p in range(len(segs)):
        (a, b), (c, d) = (cu[2 * p], cu[2 * p + 1]), (cu[2 * p + 1], cu[2 * p + 2])
        chosen, rejected = ids[a:b], ids[c:d]
        ans_c = tok.decode(chosen[labels[a:b] != -100])
        ans_r = tok.decode(rejected[labels[c:d] != -100])
        assert ans_c != ans_r  # the answers differ ...
        k = int((labels[a:b] != -100).nonzero()[0])  # ... after the same prompt (and image)
        assert np.array_equal(chosen[:k].numpy(), rejected[:k].numpy())
    assert "ref_logps" not in batch  # none precomputed in this data
    # one image per document: each pair's picture is encoded twice, in document order
    assert batch["image_grid_thw"].shape[0] == 2 * len(segs)
    assert batch["position_ids"].shape == (4, ids.numel())


def test_precomputed_reference_reaches_the_row():
    from lmms_data import collate_packed_batch
    from lmms_data._preference import pair_sample

    def doc(n):
        return {"input_ids": np.arange(n), "labels": np.arange(n), "length": n}

    pairs = [pair_sample(doc(3), doc(4), [-1.0, -2.0]), pair_sample(doc(2), doc(5), [-3.0, -4.0])]
    row = collate_packed_batch(pairs)
    assert row["ref_logps"].tolist() == [-1.0, -2.0, -3.0, -4.0]  # document order
    assert row["cu_seqlens"].tolist() == [0, 3, 7, 9, 14]
    with pytest.raises(ValueError, match="ref_logps"):
        collate_packed_batch([pairs[0], pair_sample(doc(2), doc(2))])
