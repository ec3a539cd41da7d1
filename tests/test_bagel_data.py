"""lmms-data's bagel processor: chat records (understanding, generation, editing) -> parts that
lmms-models' bagel packer turns into one row the tiny model trains on."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import lmms_data
from lmms_models import get_model_spec
from lmms_models.families.bagel import pack_samples, pixel_space_latents
from lmms_models.objectives import ObjectiveContext, get_objective


def _png(h: int, w: int, color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    info = lmms_data.build_local_processor(str(tmp_path_factory.mktemp("tok")), "qwen2_5_vl")
    cls = lmms_data.PROCESSOR_REGISTRY.get("bagel")
    return cls(info["path"], vit_patch_size=4, max_vit_side=16, latent_downsample=8,
               max_gen_side=32)  # fmt: skip


def _msg(role: str, *content: dict) -> dict:
    return {"role": role, "content": list(content)}


def test_records_of_each_kind_become_parts_and_train(proc):
    img = {"type": "image", "image": _png(20, 30, (200, 10, 10))}
    und = [_msg("user", img, {"type": "text", "text": "what colour?"}),
           _msg("assistant", {"type": "text", "text": "red"})]  # fmt: skip
    gen = [_msg("user", {"type": "text", "text": "a red square"}), _msg("assistant", img)]
    edit = [_msg("user", img, {"type": "text", "text": "make it blue"}),
            _msg("assistant", {"type": "image", "image": _png(20, 30, (10, 10, 200))})]  # fmt: skip
    out = [proc(r) for r in (und, gen, edit)]
    kinds = [[p["type"] for p in o["parts"] if p["type"] != "text"] for o in out]
    assert kinds == [["vit"], ["vae_gen"], ["vit", "vae_cond", "vae_gen"]]
    vit = next(p for p in out[0]["parts"] if p["type"] == "vit")
    assert vit["pixels"].shape == (3, 8, 16)  # longer side 16, multiples of the patch 4
    assert float(vit["pixels"].min()) >= -1.0 and float(vit["pixels"].max()) <= 1.0
    gen_part = next(p for p in out[1]["parts"] if p["type"] == "vae_gen")
    assert gen_part["pixels"].shape == (3, 16, 24)
    # assistant text is supervised, the prompt is not
    sup = [p for p in out[0]["parts"] if p["type"] == "text" and p["loss"]]
    assert sup and all(p["type"] != "text" or not p["loss"] for p in out[1]["parts"][:3])

    spec = get_model_spec("bagel")
    conf = spec.tiny_config(latent_channels=3, latent_patch_size=2, vae_downsample=4)
    model = spec.build(config=conf)
    row = pack_samples([o["parts"] for o in out], spec.make_config(conf),
                       start_of_image=out[0]["start_of_image"], end_of_image=out[0]["end_of_image"],
                       encode=pixel_space_latents(4))  # fmt: skip
    assert row["input_ids"].numel() == sum(o["length"] for o in out)
    res = get_objective("ce_flow_matching").loss(spec, model, row, ObjectiveContext())
    assert torch.isfinite(res.loss_sum) and int(res.count) == row["num_loss_tokens"]
    assert float(res.metrics["fm"][1]) == (16 // 8) * (24 // 8) * 2  # two generated images

    # the trainer's path: the loader's row of parts -> finish_pack (pixels kept, encoded on the
    # device by the pixel-space stand-in) == the row encoded at pack time; a padding sample to a
    # fixed row length (CUDA rows) changes nothing of the loss or the gradients
    from lmms_data.processors import collate_parts

    model.pixel_space_vae = True
    parts_row = collate_parts([dict(o, seed=i) for i, o in enumerate(out)])
    assert parts_row["vision_tokens"] == 2 * (8 // 4) * (16 // 4)  # two understood images
    grads = []
    for pad_to in (None, row["input_ids"].numel() + 7):
        packed = spec.finish_pack(conf, parts_row, pad_to=pad_to)
        assert packed["num_samples"] == 3 and "vae_pixels" in packed
        model.zero_grad()
        got = get_objective("ce_flow_matching").loss(spec, model, packed, ObjectiveContext())
        assert torch.equal(got.loss_sum, res.loss_sum) and int(got.count) == int(res.count)
        got.loss_sum.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))
    with pytest.raises(ValueError, match="latent_downsample must match"):
        spec.finish_pack(spec.tiny_config(latent_channels=3, vae_downsample=2), parts_row)


def test_a_record_with_nothing_to_learn_is_a_bad_record(proc):
    with pytest.raises(lmms_data.BadRecordError, match="nothing to learn"):
        proc([_msg("user", {"type": "text", "text": "hi"})])
    with pytest.raises(lmms_data.BadRecordError, match="cannot take video"):
        proc([_msg("user", {"type": "video", "video": "x.mp4"})])
    assert np.isclose(proc.start_of_image, proc.tokenizer.convert_tokens_to_ids("<|vision_start|>"))
