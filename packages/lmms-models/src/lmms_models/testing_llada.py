"""A LLaDA-layout folder written by hand for tests: ``config.json`` with the keys of LLaDA-8B's
public release (tiny values) and safetensors shards under the release's parameter names
(``model.transformer.blocks.N.ff_proj.weight``, ...), random weights. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["llada_conf", "llada_weights", "write_llada"]

D, HEADS, KV, LAYERS, MLP, VOCAB, THETA, EPS = 64, 4, 2, 2, 96, 512, 500000.0, 1e-5


def llada_conf(**over: object) -> dict:
    """config.json with the keys of LLaDA-8B's public release (tiny values)."""
    conf = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": D, "embedding_dropout": 0.0, "embedding_size": VOCAB, "eos_token_id": 500,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
        "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
        "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": 501, "max_sequence_length": 4096,
        "mlp_hidden_size": MLP, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": HEADS, "n_kv_heads": KV, "n_layers": LAYERS,
        "pad_token_id": 500, "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": EPS, "rope": True, "rope_full_precision": True, "rope_theta": THETA,
        "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
        "vocab_size": VOCAB, "weight_tying": False,
    }  # fmt: skip
    conf.update(over)
    return conf


def llada_weights(seed: int = 0, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Random tensors under the release's names ([out, in] matrices, norms near 1)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    hd = D // HEADS
    out = {"model.transformer.wte.weight": w(vocab, D),
           "model.transformer.ln_f.weight": 1 + w(D),
           "model.transformer.ff_out.weight": w(vocab, D)}  # fmt: skip
    for i in range(LAYERS):
        b = f"model.transformer.blocks.{i}."
        out |= {b + "attn_norm.weight": 1 + w(D), b + "ff_norm.weight": 1 + w(D),
                b + "q_proj.weight": w(HEADS * hd, D), b + "k_proj.weight": w(KV * hd, D),
                b + "v_proj.weight": w(KV * hd, D), b + "attn_out.weight": w(D, HEADS * hd),
                b + "ff_proj.weight": w(MLP, D), b + "up_proj.weight": w(MLP, D),
                b + "ff_out.weight": w(D, MLP)}  # fmt: skip
    return out


def write_llada(folder: Path, conf: dict | None = None, weights: dict | None = None) -> Path:
    """A LLaDA-layout folder: config.json and two safetensors shards with an index."""
    folder.mkdir(parents=True, exist_ok=True)
    conf = conf or llada_conf()
    weights = weights if weights is not None else llada_weights()
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder
