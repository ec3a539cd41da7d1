"""LLaDA's checkpoint layout <-> the ``llama`` family (upstream ``LlamaForCausalLM``).

LLaDA-8B (Base / Instruct / 1.5) releases a LLaMA-architecture decoder with bidirectional
attention under OLMo-style names and its own config (``model_type: "llada"``, ``auto_map`` to
remote code). Nothing of that code is needed: the block is the LLaMA block, so a folder reads as
the ``llama`` family with the config keys and parameter names translated here, both ways:

==========================================  ==========================================
LLaDA (``model.transformer.`` + ...)        upstream LLaMA
==========================================  ==========================================
``wte.weight``                              ``model.embed_tokens.weight``
``blocks.N.attn_norm.weight``               ``model.layers.N.input_layernorm.weight``
``blocks.N.{q,k,v}_proj.weight``            ``model.layers.N.self_attn.{q,k,v}_proj.weight``
``blocks.N.attn_out.weight``                ``model.layers.N.self_attn.o_proj.weight``
``blocks.N.ff_norm.weight``                 ``model.layers.N.post_attention_layernorm.weight``
``blocks.N.ff_proj.weight`` (SiLU side)     ``model.layers.N.mlp.gate_proj.weight``
``blocks.N.up_proj.weight``                 ``model.layers.N.mlp.up_proj.weight``
``blocks.N.ff_out.weight``                  ``model.layers.N.mlp.down_proj.weight``
``ln_f.weight``                             ``model.norm.weight``
``ff_out.weight`` (absent if tied)          ``lm_head.weight``
==========================================  ==========================================

Config: ``d_model -> hidden_size``, ``n_heads``, ``n_kv_heads``, ``n_layers``,
``mlp_hidden_size`` (else ``mlp_ratio * d_model``) ``-> intermediate_size``, ``embedding_size``
(else ``vocab_size``) ``-> vocab_size`` (the table's rows), ``max_sequence_length``,
``rope_theta``, ``rms_norm_eps``, ``weight_tying -> tie_word_embeddings``; ``is_causal: false``
and ``mask_token_id`` (LLaDA's 126336 when the config has none) are set. Options of the OLMo
block that a LLaMA decoder cannot express (ALiBi, q/k norms, biases, LayerNorm, ...) are refused.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LLADA_MASK_TOKEN_ID",
    "export_llada",
    "hf_to_llada_name",
    "is_llada_folder",
    "llada_config",
    "llada_to_hf_name",
    "llama_to_llada_config",
    "pretrained_key_map",
    "read_llada_weights",
]

#: LLaDA-8B's ``<|mdm_mask|>`` token id (the default when a config has no ``mask_token_id``).
LLADA_MASK_TOKEN_ID = 126336
_PREFIX = "model.transformer."
_BLOCK = {  # LLaDA block module -> upstream LLaMA decoder layer module
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}
#: OLMo-block options that the upstream LLaMA decoder computes one way only: (key, values read
#: as that way). A config with another value is refused rather than run differently.
_FIXED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("block_type", ("llama",)),
    ("activation_type", ("silu",)),
    ("layer_norm_type", ("rms",)),
    ("layer_norm_with_affine", (True, None)),
    ("bias_for_layer_norm", (False, None)),
    ("attention_layer_norm", (False, None)),
    ("alibi", (False, None)),
    ("rope", (True, None)),
    ("include_bias", (False, None)),
    ("include_qkv_bias", (False, None)),
    ("input_emb_norm", (False, None)),
    ("scale_logits", (False, None)),
    ("clip_qkv", (None,)),
    ("block_group_size", (1, None)),
)

#: Keys of the release's config that do not change the forward (training-time settings of the
#: original code), written as the release has them so the folder reads like one.
_RELEASE_DEFAULTS: dict[str, Any] = dict(
    alibi_bias_max=8.0,
    attention_dropout=0.0,
    attention_layer_norm_with_affine=True,
    embedding_dropout=0.0,
    flash_attention=False,
    init_cutoff_factor=None,
    init_device="meta",
    init_fn="mitchell",
    init_std=0.02,
    precision="amp_bf16",
    residual_dropout=0.0,
)


def llada_to_hf_name(name: str) -> str:
    """``model.transformer.blocks.3.ff_proj.weight`` -> ``model.layers.3.mlp.gate_proj.weight``."""
    if not name.startswith(_PREFIX):
        raise KeyError(f"{name!r} is not a LLaDA parameter name (no {_PREFIX!r} prefix)")
    rest = name[len(_PREFIX) :]
    m = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.(weight|bias)", rest)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", rest)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"{name!r}: no LLaMA parameter for this LLaDA name")


def hf_to_llada_name(name: str) -> str:
    """The inverse of :func:`llada_to_hf_name`."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+(?:\.\w+)?)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"{_PREFIX}blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(model\.\w+|lm_head)\.(weight|bias)", name)
    if m and m.group(1) in _TOP_BACK:
        return f"{_PREFIX}{_TOP_BACK[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"{name!r}: no LLaDA parameter for this LLaMA name")


def _read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder!r} (only local folders are read)")
    return json.loads(path.read_text())


def is_llada_folder(folder: str | Path) -> bool:
    """Whether ``folder/config.json`` says ``model_type: llada``."""
    path = Path(folder) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("model_type") == "llada"


def llada_config(folder_or_conf: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The ``llama`` family config dict of a LLaDA folder (or of its ``config.json`` dict)."""
    conf = folder_or_conf if isinstance(folder_or_conf, dict) else _read_config(folder_or_conf)
    if conf.get("model_type") != "llada":
        raise ValueError(f"not a LLaDA config (model_type {conf.get('model_type')!r})")
    for key, ok in _FIXED:
        if conf.get(key) not in ok:
            raise ValueError(
                f"LLaDA config {key}={conf.get(key)!r}: only {ok[0]!r} maps onto the LLaMA "
                "decoder (this release is not a LLaMA-block LLaDA)"
            )
    d_model, n_heads = int(conf["d_model"]), int(conf["n_heads"])
    n_kv = 1 if conf.get("multi_query_attention") else conf.get("n_kv_heads") or n_heads
    mlp = conf.get("mlp_hidden_size") or int(conf.get("mlp_ratio", 4)) * d_model
    out: dict[str, Any] = dict(
        vocab_size=int(conf.get("embedding_size") or conf["vocab_size"]),
        hidden_size=d_model,
        intermediate_size=int(mlp),
        num_hidden_layers=int(conf["n_layers"]),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=d_model // n_heads,
        max_position_embeddings=int(conf.get("max_sequence_length", 4096)),
        rms_norm_eps=float(conf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(conf.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(conf.get("weight_tying", False)),
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=False,
        is_causal=False,
        mask_token_id=int(conf.get("mask_token_id", LLADA_MASK_TOKEN_ID)),
        lmms_diffusion_shift=False,  # position i predicts token i
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # absent: none (not LLaMA's)
        out[key] = None if conf.get(key) is None else int(conf[key])
    return out


def llama_to_llada_config(conf: dict[str, Any], *, mask_token_id: int | None = None) -> dict:
    """A LLaDA ``config.json`` dict (the release's keys) for a ``llama`` config dict."""
    rope = conf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", conf.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" or conf.get("rope_scaling"):
        raise ValueError("LLaDA's layout has plain RoPE; this config scales it")
    if conf.get("attention_bias") or conf.get("mlp_bias"):
        raise ValueError("LLaDA's LLaMA block has no biases; this config has")
    d, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    if int(conf.get("head_dim") or d // heads) != d // heads:
        raise ValueError("LLaDA's layout has head_dim = d_model / n_heads")
    mask = mask_token_id if mask_token_id is not None else conf.get("mask_token_id")
    out: dict[str, Any] = {k: v for k, ok in _FIXED for v in [ok[0]] if v is not None}
    out.update(
        model_type="llada",
        architectures=["LLaDAModelLM"],
        d_model=d,
        n_heads=heads,
        n_kv_heads=int(conf.get("num_key_value_heads") or heads),
        n_layers=int(conf["num_hidden_layers"]),
        mlp_hidden_size=int(conf["intermediate_size"]),
        mlp_ratio=4,  # the release's value; unused while mlp_hidden_size is set
        vocab_size=int(conf["vocab_size"]),
        embedding_size=int(conf["vocab_size"]),
        max_sequence_length=int(conf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(conf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_full_precision=True,
        weight_tying=bool(conf.get("tie_word_embeddings", False)),
        mask_token_id=int(LLADA_MASK_TOKEN_ID if mask is None else mask),
        multi_query_attention=None,
        use_cache=False,
        **_RELEASE_DEFAULTS,
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(conf.get(key), int):
            out[key] = conf[key]
    return out


def read_llada_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a LLaDA folder's safetensors, under the upstream LLaMA names."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({llada_to_hf_name(k): v for k, v in load_file(str(f)).items()})
    return out


def pretrained_key_map(folder: str | Path | None) -> Callable[[str], str | None] | None:
    """The checkpoint-name -> model-name map for ``folder`` (``None``: names already match).

    The trainer's FSDP2 load reads the safetensors on rank 0 and broadcasts; this renames them.
    """
    if folder is None or not is_llada_folder(folder):
        return None
    return llada_to_hf_name


def export_llada(
    src: str | Path,
    dst: str | Path,
    *,
    mask_token_id: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a ``llama``-family dLLM folder (lmms layout, unshifted) in LLaDA's layout.

    The tensors are renamed, never converted (their bytes are the source's); ``config.json``
    gets LLaDA's keys; tokenizer and other files are copied. LLaDA's modeling code (``auto_map``)
    is not written: lmms reads the folder without it.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    conf = _read_config(src)
    if conf.get("model_type") != "llama":
        raise ValueError(
            f"LLaDA's layout is a LLaMA decoder; {src} holds {conf.get('model_type')!r}"
        )
    if conf.get("lmms_diffusion_shift"):
        raise ValueError(f"{src} predicts token i+1 at position i; LLaDA reads position i")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {src}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    if conf.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    named = {hf_to_llada_name(k): v.contiguous() for k, v in sorted(tensors.items())}
    dst.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in named.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(dst / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(v.numel() * v.element_size() for v in named.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    skip = {"config.json", "model.safetensors.index.json"}
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, dst / f.name)
    out = llama_to_llada_config(conf, mask_token_id=mask_token_id)
    (dst / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return dst
