"""BAGEL: a Qwen2.5 Mixture-of-Transformers decoder, a SigLIP NaViT encoder and VAE latent tokens.

Written once here (transformers has no class) with the parameter names and shapes of the public
BAGEL checkpoints (``ema.safetensors`` of BAGEL-7B-MoT):

* ``language_model.model.embed_tokens``, ``language_model.model.layers.N.*``,
  ``language_model.model.norm`` / ``norm_moe_gen``, ``language_model.lm_head``. Every decoder
  layer holds two sets of weights: the understanding set (``self_attn.{q,k,v,o}_proj``,
  ``self_attn.{q,k}_norm``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``) for text
  and ViT tokens, and the generation set (the same names with ``_moe_gen``) for VAE latent tokens.
  Attention is one softmax over the whole sample: each token's q/k/v come from its own set.
* ``vit_model.vision_model.{embeddings.patch_embedding (a Linear on (p, q, c) patches),
  embeddings.position_embedding, encoder.layers.N.*, post_layernorm}``: SigLIP at native
  resolution, each image its own varlen segment; ``connector.{fc1,fc2}`` and the fixed
  ``vit_pos_embed.pos_embed`` table map its tokens into the decoder.
* ``vae2llm`` / ``llm2vae`` (latent patch <-> hidden), ``time_embedder.mlp.{0,2}`` and the fixed
  ``latent_pos_embed.pos_embed`` table: a VAE latent token is
  ``vae2llm(x_t patch) + time_embedder(t) + pos(row * max_latent_size + col)``.

Time: ``t`` is the noise level (0 = clean latent, 1 = pure noise); ``x_t = (1 - t) x + t eps`` and
the network predicts the velocity ``eps - x`` (lmms_models._flow_matching's ``rectified_flow``
convention with ``timestep_scale = 1``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...parts.latent import GeluMlp, TimestepEmbedder, sincos_2d
from ._mask import PackLayout, span_attention

__all__ = [
    "Bagel",
    "BagelConfig",
    "LLMConfig",
    "MoTDecoderLayer",
    "SiglipEncoderLayer",
    "ViTConfig",
    "sincos_table",
]


@dataclass(kw_only=True, slots=True)
class LLMConfig:
    """The Qwen2.5 decoder (BAGEL-7B-MoT: Qwen2.5-7B with QK-norm)."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(kw_only=True, slots=True)
class ViTConfig:
    """SigLIP so400m/14 at 980 px, the last layer dropped (``vit_select_layer = -2``: 26 layers)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 26
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    image_size: int = 980
    layer_norm_eps: float = 1e-6

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(kw_only=True, slots=True)
class BagelConfig:
    """Top-level hyper-parameters (``BagelConfig`` of the reference, flattened)."""

    model_type: str = "bagel"
    llm: LLMConfig = field(default_factory=LLMConfig)
    vit: ViTConfig = field(default_factory=ViTConfig)
    latent_channels: int = 16  # FLUX VAE z_channels
    vae_downsample: int = 8
    latent_patch_size: int = 2
    max_latent_size: int = 64  # latent patches per side of the position table
    vit_max_num_patch_per_side: int = 70

    @classmethod
    def from_dict(cls, conf: dict[str, Any]) -> BagelConfig:
        conf = dict(conf)
        llm, vit = conf.pop("llm", {}), conf.pop("vit", {})
        conf.pop("model_type", None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(conf) - known)
        if unknown:
            raise ValueError(f"bagel config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(llm=LLMConfig(**llm), vit=ViTConfig(**vit), **conf)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def patch_latent_dim(self) -> int:
        return self.latent_patch_size**2 * self.latent_channels


# ------------------------------------------------------------------------------ small pieces
def sincos_table(dim: int, side: int) -> torch.Tensor:
    """Fixed 2-D sin-cos table ``[side * side, dim]`` (row-major: row ``i * side + j``; first half
    of the channels encodes the column, second half the row): BAGEL's ``pos_embed`` values, the
    DiT/MAE layout shared with the ``sit`` family."""
    return sincos_2d(dim, side, side)


class PositionTable(nn.Module):
    """``pos_embed [side^2, hidden]``: fixed sin-cos rows looked up by flattened 2-D position."""

    def __init__(self, side: int, hidden: int) -> None:
        super().__init__()
        self.side, self.hidden = side, hidden
        self.register_buffer("pos_embed", sincos_table(hidden, side), persistent=True)

    def reset_table(self) -> None:
        """Recompute the table (after a build on the meta device)."""
        self.pos_embed = sincos_table(self.hidden, self.side).to(self.pos_embed.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.pos_embed[ids]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def routed(
    x: torch.Tensor,  # [T, ...]
    gen: torch.Tensor,  # [T] bool: generation (VAE latent) tokens
    und_fn: Any,
    gen_fn: Any,
) -> torch.Tensor:
    """``und_fn`` on understanding tokens, ``gen_fn`` on generation tokens, in sequence order.
    Each token's work runs exactly once (MoT: executed FLOPs = one expert per token). Both run
    even on an empty selection, so every weight has a (zero) gradient on every rank: FSDP2's
    reduce-scatter sees the same parameters everywhere."""
    und_idx = (~gen).nonzero().squeeze(1)
    gen_idx = gen.nonzero().squeeze(1)
    a, b = und_fn(x[und_idx]), gen_fn(x[gen_idx])
    out = a.new_empty(x.shape[0], *a.shape[1:])
    return out.index_copy(0, und_idx, a).index_copy(0, gen_idx, b)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [T, H, D]`` with ``cos/sin [T, 1, D]`` (Qwen2 layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_tables(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, 1, head_dim]`` for 1-D positions ``[T]``."""
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    ang = position_ids.float()[:, None] * inv[None]  # [T, D/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ------------------------------------------------------------------------------ MoT decoder
class MoTAttention(nn.Module):
    """Shared attention over the sequence; q/k/v/o projections and QK-norms per token type.
    ``attend(q, k, v, layout)``: the span attention of the row (sequence parallelism wraps it on
    the instance: lmms_parallel's ``sp_row_attention`` style, ``BagelSpec.sp_plan``)."""

    attend = staticmethod(span_attention)

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        for suffix in ("", "_moe_gen"):
            setattr(self, "q_proj" + suffix, nn.Linear(h, self.heads * d))
            setattr(self, "k_proj" + suffix, nn.Linear(h, self.kv_heads * d))
            setattr(self, "v_proj" + suffix, nn.Linear(h, self.kv_heads * d))
            setattr(self, "o_proj" + suffix, nn.Linear(self.heads * d, h, bias=False))
            norm = (lambda: RMSNorm(d, cfg.rms_norm_eps)) if cfg.qk_norm else nn.Identity
            setattr(self, "q_norm" + suffix, norm())
            setattr(self, "k_norm" + suffix, norm())

    def _qkv(self, suffix: str, x: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        q = getattr(self, "q_proj" + suffix)(x).unflatten(-1, (self.heads, d))
        k = getattr(self, "k_proj" + suffix)(x).unflatten(-1, (self.kv_heads, d))
        v = getattr(self, "v_proj" + suffix)(x).unflatten(-1, (self.kv_heads, d))
        q, k = getattr(self, "q_norm" + suffix)(q), getattr(self, "k_norm" + suffix)(k)
        return torch.cat([q, k, v], dim=1)  # [N, H + 2 KV, D]

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        gen: torch.Tensor,  # [T] bool
        rope_cs: tuple[torch.Tensor, torch.Tensor],
        layout: PackLayout,
    ) -> torch.Tensor:
        qkv = routed(x, gen, lambda a: self._qkv("", a), lambda a: self._qkv("_moe_gen", a))
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = rope(q, *rope_cs), rope(k, *rope_cs)
        out = self.attend(q, k, v, layout).flatten(1)  # [T, H * D]
        return routed(out, gen, self.o_proj, self.o_proj_moe_gen)


class MoTDecoderLayer(nn.Module):
    """One BAGEL decoder layer: pre-norm attention and SwiGLU, each with a generation twin."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = MoTAttention(cfg)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.mlp_moe_gen = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_moe_gen = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        gen: torch.Tensor,
        rope_cs: tuple[torch.Tensor, torch.Tensor],
        layout: PackLayout,
    ) -> torch.Tensor:
        normed = routed(x, gen, self.input_layernorm, self.input_layernorm_moe_gen)
        x = x + self.self_attn(normed, gen, rope_cs, layout)

        def und(a: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.post_attention_layernorm(a))

        def gen_fn(a: torch.Tensor) -> torch.Tensor:
            return self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(a))

        return x + routed(x, gen, und, gen_fn)


class _Qwen2MoTModel(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] the embedded row
        gen: torch.Tensor,  # [T] bool: generation tokens
        rope_cs: tuple[torch.Tensor, torch.Tensor],
        layout: PackLayout,
    ) -> torch.Tensor:
        """The decoder stack: every layer, then each token's own expert's final norm."""
        for layer in self.layers:
            x = layer(x, gen, rope_cs, layout)
        return routed(x, gen, self.norm, self.norm_moe_gen)


class _Qwen2MoTForCausalLM(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.model = _Qwen2MoTModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


# ------------------------------------------------------------------------------ SigLIP NaViT
class _SiglipAttention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.v_proj, self.out_proj = nn.Linear(h, h), nn.Linear(h, h)

    def forward(
        self, x: torch.Tensor, cu: torch.Tensor, max_len: int, backend: str
    ) -> torch.Tensor:
        from lmms_kernels import varlen_attention

        q, k, v = (
            p(x).unflatten(-1, (self.heads, -1)) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=False, backend=backend)
        return self.out_proj(out.flatten(1))  # [N, hidden]


class _SiglipMLP(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.self_attn = _SiglipAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _SiglipMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, cu: torch.Tensor, max_len: int, backend: str
    ) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cu, max_len, backend)
        return x + self.mlp(self.layer_norm2(x))


class _SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size**2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)


class _SiglipEncoder(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class _SiglipTransformer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.embeddings = _SiglipEmbeddings(cfg)
        self.encoder = _SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class SiglipNaViT(nn.Module):
    """``forward(patches [N, C*p*p], pos [N], cu [n+1]) -> [N, vit_hidden]``: each image is one
    varlen segment (lmms_kernels.varlen_attention, bidirectional)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_model = _SiglipTransformer(cfg)
        self.attn_backend = "auto"

    def forward(self, patches: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        vm = self.vision_model
        x = vm.embeddings.patch_embedding(patches) + vm.embeddings.position_embedding(pos)
        max_len = int((cu[1:] - cu[:-1]).max())
        for layer in vm.encoder.layers:
            x = layer(x, cu, max_len, self.attn_backend)
        return vm.post_layernorm(x)


# ------------------------------------------------------------------------------ BAGEL
class Bagel(nn.Module):
    """The whole model, single-device and loss-free. :meth:`hidden_states` runs one packed row
    (see ``_pack.py`` for the batch keys); :meth:`forward` adds the latent velocity predictions.
    The losses are the objective's (``ce_flow_matching``, or ``causal_lm`` through
    ``BagelSpec.packed_forward``); sequence parallelism is installed from outside
    (``BagelSpec.sp_plan``, applied by lmms-parallel)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.llm.hidden_size
        self.language_model = _Qwen2MoTForCausalLM(cfg.llm)
        self.vit_model = SiglipNaViT(cfg.vit)
        self.connector = GeluMlp(cfg.vit.hidden_size, h, h)
        self.vit_pos_embed = PositionTable(cfg.vit_max_num_patch_per_side, h)
        self.time_embedder = TimestepEmbedder(h)
        self.vae2llm = nn.Linear(cfg.patch_latent_dim, h)
        self.llm2vae = nn.Linear(h, cfg.patch_latent_dim)
        self.latent_pos_embed = PositionTable(cfg.max_latent_size, h)
        nn.init.zeros_(self.llm2vae.weight)  # the reference starts the velocity head at zero
        nn.init.zeros_(self.llm2vae.bias)

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.model.layers

    def embed(self, batch: dict[str, Any], vae_tokens: torch.Tensor | None,
              vae_time: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """The packed input sequence ``[T, hidden]``: text embeddings, connector(ViT) + position
        rows at ViT slots, ``vae2llm(x_t) + time + position`` at VAE slots."""
        lm = self.language_model.model
        ids = batch["input_ids"]
        x = lm.embed_tokens(ids)  # [T, hidden]; non-text slots are overwritten
        if batch["vit_patches"].shape[0]:
            pos = batch["vit_pos"]
            feats = self.vit_model(batch["vit_patches"].to(x.dtype), pos, batch["vit_cu"])
            feats = self.connector(feats) + self.vit_pos_embed(pos).to(x.dtype)
            x = x.index_copy(0, batch["vit_index"], feats)
        else:  # no image on this rank: a dummy patch keeps the tower in the graph (FSDP2)
            dummy = x.new_zeros(
                1, self.vit_model.vision_model.embeddings.patch_embedding.in_features
            )
            one = torch.zeros(1, dtype=torch.long, device=x.device)
            cu = torch.tensor([0, 1], dtype=torch.int32, device=x.device)
            x = x + 0.0 * self.connector(self.vit_model(dummy, one, cu)).sum()
        if vae_tokens is None:
            if batch["vae_pos"].numel():
                raise ValueError("bagel: the row has VAE latent slots; pass vae_tokens/vae_time")
            vae_tokens = x.new_zeros(0, self.config.patch_latent_dim)
            vae_time = x.new_zeros(0)
        feats = self.vae2llm(vae_tokens.to(x.dtype)) + self.time_embedder(vae_time)
        feats = feats + self.latent_pos_embed(batch["vae_pos"]).to(x.dtype)
        x = x.index_copy(0, batch["vae_index"], feats)
        return x

    def hidden_states(self, batch: dict[str, Any], vae_tokens: torch.Tensor | None = None,
                      vae_time: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Final hidden states ``[T, hidden]`` (each token normed by its own expert's norm)."""
        x = self.embed(batch, vae_tokens, vae_time)
        gen = batch["token_type"] == 2  # [T] VAE latent tokens: the generation expert
        cs = rope_tables(
            batch["position_ids"], self.config.llm.head_dim, self.config.llm.rope_theta, x.dtype
        )
        return self.language_model.model(x, gen, cs, batch["layout"])

    def forward(
        self,
        batch: dict[str, Any],
        vae_tokens: torch.Tensor | None = None,  # [Ng, p*p*C] noised latent patches
        vae_time: torch.Tensor | None = None,  # [Ng] noise level per latent token
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [T, hidden], velocity predictions [Ng_loss, p*p*C])``: the final hidden
        states of the row (the LM head and its cross-entropy are the objective's) and the
        velocity head at the noised latent tokens (``batch["fm_index"]``, maybe none)."""
        hidden = self.hidden_states(batch, vae_tokens, vae_time)
        return hidden, self.llm2vae(hidden[batch["fm_index"]])
