"""dLLM checkpoints through local folders (lmms and Dream layouts) and the diffusion sampler."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmms_models import get_model_spec
from lmms_models.layouts import export_dream, load_dllm, read_layout
from lmms_models.objectives import diffusion_generate, get_objective

MASK_ID = 1001


def _dllm_folder(tmp_path, *, shift: bool):
    """A tiny qwen2 trained-as-dLLM folder in lmms' layout (what lmms-train exports)."""
    torch.manual_seed(0)
    spec = get_model_spec("qwen2")
    model = spec.build(config=spec.tiny_config())
    get_objective("masked_diffusion", mask_token_id=MASK_ID, shift=shift).prepare_model(spec, model)
    out = tmp_path / f"lmms_shift{int(shift)}"
    model.save_pretrained(out)
    return spec, model, out


def test_dream_layout_round_trip_without_remote_code(tmp_path):
    _, model, src = _dllm_folder(tmp_path, shift=True)
    conf = json.loads((src / "config.json").read_text())
    assert conf["is_causal"] is False and conf["mask_token_id"] == MASK_ID
    assert conf["lmms_diffusion_shift"] is True and read_layout(src)[2] is True

    dream = export_dream(src, tmp_path / "dream")
    dconf = json.loads((dream / "config.json").read_text())
    assert dconf["model_type"] == "Dream" and dconf["architectures"] == ["DreamModel"]
    assert dconf["mask_token_id"] == MASK_ID and not any(k.startswith("lmms_") for k in dconf)
    a, b = load_file(src / "model.safetensors"), load_file(dream / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # Qwen2 names kept
    assert "model.layers.0.self_attn.q_proj.bias" in b  # Dream's (= Qwen2's) parameter names

    # a release's auto_map names remote code that is not there: it must never be imported
    dconf["auto_map"] = {"AutoModel": "modeling_dream.DreamModel"}
    (dream / "config.json").write_text(json.dumps(dconf))
    ckpt = load_dllm(dream)
    assert ckpt.spec.name == "qwen2" and ckpt.shift is True and ckpt.mask_token_id == MASK_ID
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt.model.state_dict()[k], v), k
    attn = ckpt.model.model.layers[0].self_attn
    assert attn.is_causal is False  # bidirectional after loading
    ids = torch.randint(0, 1000, (1, 12))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(ckpt.model(input_ids=ids).logits, model(input_ids=ids).logits)
        ids2 = ids.clone()
        ids2[0, -1] = (ids2[0, -1] + 1) % 1000
        first = ckpt.model(input_ids=ids).logits[0, 0]
        assert not torch.equal(first, ckpt.model(input_ids=ids2).logits[0, 0])  # sees the future


def test_refusals(tmp_path):
    _, _, same = _dllm_folder(tmp_path, shift=False)
    with pytest.raises(ValueError, match="shift: true"):
        export_dream(same, tmp_path / "d")
    spec = get_model_spec("qwen3")
    causal = spec.build(config=spec.tiny_config())
    causal.config.mask_token_id = MASK_ID
    causal.save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match="is_causal: false"):
        load_dllm(tmp_path / "causal")
    with pytest.raises(ValueError, match="Qwen2 decoder"):
        export_dream(tmp_path / "causal", tmp_path / "d2")


@pytest.mark.parametrize("shift", [False, True])
def test_sampler_unmasks_by_confidence_block_by_block(tmp_path, shift):
    _, _, folder = _dllm_folder(tmp_path, shift=shift)
    ckpt = load_dllm(folder)
    prompt = torch.randint(0, 1000, (5,), generator=torch.Generator().manual_seed(0))
    res = diffusion_generate(
        ckpt.model, prompt, mask_token_id=MASK_ID, gen_length=8, steps=6, block_length=4,
        shift=ckpt.shift, keep_states=True,
    )  # fmt: skip
    assert torch.equal(res.tokens[:5], prompt) and len(res.states) == 6
    masked = [int((s == MASK_ID).sum()) for s in res.states]
    assert masked == [6, 5, 4, 2, 1, 0]  # a block of 4 over 3 steps: 2, 1, 1 committed
    for s in res.states[:3]:
        assert (s[4:] == MASK_ID).all()  # the second block waits for the first
    for a, b in zip(res.states, res.states[1:], strict=False):
        kept = a != MASK_ID
        assert torch.equal(a[kept], b[kept])  # committed tokens are never remasked
    # the committed token of step 1 is the most confident proposal in block 1
    x = res.tokens.clone()
    x[5:] = MASK_ID
    with torch.no_grad():
        logits = ckpt.model(input_ids=x[None]).logits[0].float()
    if shift:
        logits = torch.cat([logits[:1], logits[:-1]])
    logits[:, MASK_ID] = -torch.inf
    conf, tok = logits.softmax(-1).max(-1)
    first = int(conf[5:9].argmax()) + 5
    assert res.states[0][first - 5] == tok[first]
    with pytest.raises(ValueError, match="multiple of block_length"):
        diffusion_generate(ckpt.model, prompt, mask_token_id=MASK_ID, gen_length=6, block_length=4)
