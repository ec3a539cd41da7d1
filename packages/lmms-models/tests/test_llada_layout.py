"""LLaDA's release layout read as the ``llama`` family: a folder written by hand with the public
release's config keys and parameter names loads without remote code, its logits equal a
from-scratch bidirectional LLaMA forward written from the layout, and the export writes the
same names, keys and tensor bytes back."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lmms_models import get_model_spec
from lmms_models.layouts import (
    DLLM_LAYOUTS,
    LLADA_MASK_TOKEN_ID,
    export_llada,
    load_dllm,
    read_layout,
)
from lmms_models.layouts.llada import (
    hf_to_llada_name,
    llada_config,
    llada_to_hf_name,
    pretrained_key_map,
)
from lmms_models.testing_llada import (
    EPS,
    HEADS,
    KV,
    LAYERS,
    MLP,
    THETA,
    D,
    llada_conf,
    llada_weights,
    write_llada,
)


def reference_logits(w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """LLaDA's forward written from its layout: RMSNorm, RoPE (half rotation), bidirectional
    GQA softmax attention, SwiGLU (``ff_proj`` through SiLU times ``up_proj``), untied head."""
    p = "model.transformer."
    hd, s = D // HEADS, ids.shape[0]

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

    inv = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)  # [s, hd/2]
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(x):  # [h, s, hd]: rotate the halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = w[p + "wte.weight"][ids]  # [s, D]
    for i in range(LAYERS):
        b = f"{p}blocks.{i}."
        h = norm(x, w[b + "attn_norm.weight"])
        q = rope((h @ w[b + "q_proj.weight"].T).view(s, HEADS, hd).transpose(0, 1))
        k = rope((h @ w[b + "k_proj.weight"].T).view(s, KV, hd).transpose(0, 1))
        v = (h @ w[b + "v_proj.weight"].T).view(s, KV, hd).transpose(0, 1)
        k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1) @ v  # no causal mask
        x = x + att.transpose(0, 1).reshape(s, D) @ w[b + "attn_out.weight"].T
        h = norm(x, w[b + "ff_norm.weight"])
        ff = F.silu(h @ w[b + "ff_proj.weight"].T) * (h @ w[b + "up_proj.weight"].T)
        x = x + ff @ w[b + "ff_out.weight"].T
    head = w.get(p + "ff_out.weight", w[p + "wte.weight"])  # weight_tying: the embedding
    return norm(x, w[p + "ln_f.weight"]) @ head.T  # [s, V]


def test_llada_folder_loads_as_llama_and_matches_the_layouts_forward(tmp_path):
    folder = write_llada(tmp_path / "llada")
    assert DLLM_LAYOUTS["llada"].family == "llama" and read_layout(folder)[:1] == ("llama",)
    assert read_layout(folder)[2] is False  # position i predicts token i
    ckpt = load_dllm(folder)  # auto_map names modules that do not exist here: never imported
    assert ckpt.spec.name == "llama" and ckpt.mask_token_id == 501 and ckpt.shift is False
    assert ckpt.model.config.is_causal is False
    ids = torch.tensor([3, 17, 501, 42, 501, 9, 250, 7])
    with torch.no_grad():
        got = ckpt.model(input_ids=ids[None]).logits[0]
        ref = reference_logits(llada_weights(), ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # bidirectional: a later token changes the first position's logits
        later = ckpt.model(input_ids=torch.cat([ids[:-1], ids.new_tensor([8])])[None]).logits[0]
    assert not torch.allclose(later[0], got[0])
    # the mask token id is configurable: the config's, LLaDA's default, or the caller's
    assert llada_config(llada_conf())["mask_token_id"] == 501
    no_mask = {k: v for k, v in llada_conf().items() if k != "mask_token_id"}
    assert llada_config(no_mask)["mask_token_id"] == LLADA_MASK_TOKEN_ID == 126336
    assert load_dllm(folder, mask_token_id=7).mask_token_id == 7


def test_names_and_keys_map_both_ways_and_unsupported_options_are_refused():
    for name in llada_weights():
        assert hf_to_llada_name(llada_to_hf_name(name)) == name
    assert llada_to_hf_name("model.transformer.blocks.1.ff_proj.weight") == (
        "model.layers.1.mlp.gate_proj.weight"
    )
    assert llada_to_hf_name("model.transformer.ff_out.weight") == "lm_head.weight"
    with pytest.raises(KeyError, match="no LLaMA parameter"):
        llada_to_hf_name("model.transformer.blocks.0.att_proj.weight")  # OLMo's fused qkv
    conf = llada_config(llada_conf())
    assert (conf["hidden_size"], conf["num_key_value_heads"], conf["intermediate_size"]) == (
        D,
        KV,
        MLP,
    )
    assert conf["rope_theta"] == THETA and conf["is_causal"] is False
    for bad in ({"alibi": True}, {"block_type": "sequential"}, {"include_qkv_bias": True},
                {"layer_norm_type": "default"}, {"attention_layer_norm": True}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            llada_config(llada_conf(**bad))
    assert llada_config(llada_conf(multi_query_attention=True))["num_key_value_heads"] == 1


def test_meta_build_and_trainer_key_map(tmp_path):
    folder = write_llada(tmp_path / "llada")
    spec = get_model_spec("llama")
    model = spec.build(pretrained=str(folder), device="meta")
    assert all(p.is_meta for p in model.parameters())
    key_map = pretrained_key_map(str(folder))
    assert key_map is not None and pretrained_key_map(str(tmp_path)) is None
    assert {key_map(k) for k in llada_weights()} == set(model.state_dict())
    bad = write_llada(tmp_path / "bad", llada_conf(n_layers=LAYERS + 1))
    with pytest.raises(ValueError, match=r"do not fit its config \(missing \['model.layers.2"):
        spec.build(pretrained=str(bad))


def test_export_writes_llada_names_keys_and_the_same_bytes(tmp_path):
    src = write_llada(tmp_path / "llada")
    ckpt = load_dllm(src)
    ckpt.model.save_pretrained(tmp_path / "lmms")  # the lmms (llama) layout
    saved = json.loads((tmp_path / "lmms" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["is_causal"] is False
    out = export_llada(tmp_path / "lmms", tmp_path / "back", max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file()  # sharded like the release
    back = {}
    for f in sorted(out.glob("*.safetensors")):
        back.update(load_file(str(f)))
    orig = llada_weights()
    assert set(back) == set(orig)
    for k, v in orig.items():  # byte for byte
        assert back[k].dtype == v.dtype and back[k].numpy().tobytes() == v.numpy().tobytes(), k
    conf = json.loads((out / "config.json").read_text())
    release = llada_conf()
    for k, v in release.items():  # every key of the release (its remote code is not written)
        if k not in ("auto_map", "transformers_version"):
            assert conf.get(k) == v, (k, conf.get(k), v)
    assert llada_config(conf) == llada_config(release)
    again = load_dllm(out)  # and it loads again
    ids = torch.arange(10, 30)
    with torch.no_grad():
        torch.testing.assert_close(
            again.model(input_ids=ids[None]).logits, ckpt.model(input_ids=ids[None]).logits
        )
    with pytest.raises(ValueError, match="LLaMA decoder"):
        export_llada(tmp_path / "back", tmp_path / "x")  # already LLaDA's layout


def test_tied_release_reads_and_writes_without_ff_out(tmp_path):
    weights = llada_weights(seed=1)
    del weights["model.transformer.ff_out.weight"]  # weight_tying: the head is wte
    src = write_llada(tmp_path / "tied", llada_conf(weight_tying=True), weights)
    ckpt = load_dllm(src)
    assert ckpt.model.config.tie_word_embeddings
    assert ckpt.model.lm_head.weight.data_ptr() == ckpt.model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([5, 99, 501, 7, 300])
    with torch.no_grad():
        got = ckpt.model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, reference_logits(weights, ids), rtol=1e-4, atol=1e-5)
    ckpt.model.save_pretrained(tmp_path / "lmms")
    out = export_llada(tmp_path / "lmms", tmp_path / "back")
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(weights)  # no ff_out written
    assert json.loads((out / "config.json").read_text())["weight_tying"] is True
