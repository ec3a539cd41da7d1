"""SiT / DiT: a class-conditional transformer on patches of VAE latents, with adaLN-Zero blocks.

Written once here with the parameter names of the public SiT/DiT checkpoints (``x_embedder``,
``t_embedder``, ``y_embedder``, ``blocks.N.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2,
adaLN_modulation.1}``, ``final_layer``) because diffusers' ``DiTTransformer2DModel`` is a different
parameterisation of the same function: every block owns a copy of the timestep and label
embedders (28 copies at XL, ~78M parameters that training would untie), its sinusoidal timestep
features use another frequency offset, and q/k/v are three matrices. The test suite maps these
weights into diffusers' class (embedders copied into every block, qkv split, its frequency offset
set to ours on the instance) and checks that both forwards agree.

The fixed 2-D sin-cos position table is computed for the latent's own grid on each call (no
buffer), so one model takes every resolution bucket.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...parts.latent import GeluMlp, TimestepEmbedder, sincos_2d, timestep_features

__all__ = ["SiT", "SiTBlock", "SiTConfig", "sincos_2d", "timestep_features"]


@dataclass(kw_only=True, slots=True)
class SiTConfig:
    """SiT/DiT hyper-parameters (SiT-XL/2: hidden 1152, depth 28, heads 16, patch 2)."""

    model_type: str = "sit"
    input_size: int = 32  # latent side of the reference resolution (256 px / VAE factor 8)
    patch_size: int = 2
    in_channels: int = 4
    hidden_size: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    num_classes: int = 1000  # the embedding table has one more row: the null (CFG) class
    learn_sigma: bool = True  # SiT checkpoints output 2C channels; training uses the first C

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]  # x [B, N, H], shift/scale [B, H]


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape  # [B, N, H]
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, heads, N, d]
        return self.proj(out.transpose(1, 2).reshape(b, n, h))


class SiTBlock(nn.Module):
    """adaLN-Zero block: the condition sets shift/scale/gate of attention and MLP."""

    def __init__(self, cfg: SiTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.attn = _Attention(h, cfg.num_heads)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = GeluMlp(h, cfg.mlp_hidden, h)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 6 * h))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        # x [B, N, H], c [B, H]
        sh1, sc1, g1, sh2, sc2, g2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + g1[:, None] * self.attn(_modulate(self.norm1(x), sh1, sc1))
        return x + g2[:, None] * self.mlp(_modulate(self.norm2(x), sh2, sc2))


class _FinalLayer(nn.Module):
    def __init__(self, cfg: SiTConfig) -> None:
        super().__init__()
        h, p = cfg.hidden_size, cfg.patch_size
        self.norm_final = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(h, p * p * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 2 * h))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class _LabelEmbedder(nn.Module):
    def __init__(self, num_classes: int, h: int) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, h)  # last row: the null class

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(y)


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: SiTConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=p, stride=p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, N, hidden]


class SiT(nn.Module):
    """``forward(x [B, C, H, W], t [B], y [B]) -> [B, out_channels, H, W]``; ``y == num_classes``
    is the null class (classifier-free guidance). ``t``: the interpolant time, 1 = data."""

    def __init__(self, cfg: SiTConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // 2) % 2:
            raise ValueError("SiT: hidden_size must divide by num_heads and by 4")
        self.config = cfg
        self.x_embedder = _PatchEmbed(cfg)
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.y_embedder = _LabelEmbedder(cfg.num_classes, cfg.hidden_size)
        self.blocks = nn.ModuleList(SiTBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = _FinalLayer(cfg)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """SiT's initialisation: xavier linears, N(0, 0.02) embedders, adaLN and output zeroed
        (so the untrained model predicts zero)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for mod in [
            *(b.adaLN_modulation[1] for b in self.blocks),
            self.final_layer.adaLN_modulation[1],
        ]:
            nn.init.zeros_(mod.weight)
            nn.init.zeros_(mod.bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def embed(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tokens ``[B, N, H]`` with positions, and the condition ``c [B, H]``."""
        p = self.config.patch_size
        tokens = self.x_embedder(x)
        pos = sincos_2d(self.config.hidden_size, x.shape[-2] // p, x.shape[-1] // p, x.device)
        tokens = tokens + pos.to(tokens.dtype)[None]
        return tokens, self.t_embedder(t) + self.y_embedder(y)

    def unpatchify(self, x: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """``[B, N, p*p*C] -> [B, C, gh*p, gw*p]``."""
        p, c = self.config.patch_size, self.config.out_channels
        x = x.reshape(x.shape[0], gh, gw, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, gh * p, gw * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.config.patch_size
        if x.shape[-1] % p or x.shape[-2] % p:
            raise ValueError(f"SiT: latent {tuple(x.shape[-2:])} not divisible by patch {p}")
        tokens, c = self.embed(x, t, y)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c), x.shape[-2] // p, x.shape[-1] // p)

    def save_pretrained(self, out_dir: str, *, state_dict: dict | None = None, **_: Any) -> None:
        """``config.json`` + ``model.safetensors`` (what ``lmms_parallel.export_hf`` calls)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        sd = state_dict if state_dict is not None else self.state_dict()
        save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
        from ..._diffusion import save_encoders

        save_encoders(self, out)

    @classmethod
    def from_pretrained(cls, path: str, **_: Any) -> SiT:
        """The inverse of :meth:`save_pretrained` (a local folder)."""
        from safetensors.torch import load_file

        conf = json.loads((Path(path) / "config.json").read_text())
        fields = set(SiTConfig.__dataclass_fields__)
        model = cls(SiTConfig(**{k: v for k, v in conf.items() if k in fields}))
        model.load_state_dict(load_file(str(Path(path) / "model.safetensors")))
        return model
