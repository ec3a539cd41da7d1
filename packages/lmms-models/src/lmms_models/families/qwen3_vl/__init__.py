"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3 decoder with interleaved mRoPE, a ViT with
full attention everywhere and learned (interpolated) position embeddings, and *deepstack*: features
of a few ViT layers are merged and added to the hidden states of the first decoder layers at the
visual positions. The upstream model does all of that; the packed forward only feeds it."""

from __future__ import annotations

from typing import Any

import torch

from ... import _flops
from ..._registry import register_model
from ..._vl import TINY_TOKEN_IDS, QwenVLSpec, merge_tiny, vision_utils

__all__ = ["Qwen3VLSpec"]

_TINY: dict[str, Any] = {
    "text_config": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "use_cache": False,
        "bos_token_id": 1004,
        "eos_token_id": 1005,
    },
    "vision_config": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
        "in_channels": 3,
    },
    **TINY_TOKEN_IDS,
    "tie_word_embeddings": False,
}


@register_model("qwen3_vl")
class Qwen3VLSpec(QwenVLSpec):
    processor_family = "qwen3_vl"
    config_class = "Qwen3VLConfig"
    model_class = "Qwen3VLForConditionalGeneration"
    mrope_rows_only = True  # its text model's mask preparation reads the text row on the host

    def host_vision_inputs(self, tower: Any, grid_thw: torch.Tensor) -> dict[str, Any]:
        """The learned position embedding's bilinear interpolation (indices, weights), rotary
        position ids and per-frame ``cu_seqlens`` with its maximum, from the host grid, by
        transformers' own helpers with the tower's settings."""
        vu = vision_utils()
        grid = grid_thw.reshape(-1, 3).cpu()
        merge = tower.config.spatial_merge_size
        indices, weights = vu.get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=tower.num_grid_per_side,
            mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners,
            spatial_merge_size=merge,
        )
        cu = vu.get_vision_cu_seqlens(grid)
        return {
            "interp_indices": indices,
            "interp_weights": weights,
            "position_ids": vu.get_vision_position_ids(grid, merge),
            "cu_seqlens": cu,
            "max_seqlen": int((cu[1:] - cu[:-1]).max()),
        }

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)

    def lm_matmul_params(self, config: Any) -> int:
        cfg = self.text_config(config)
        bias = bool(_flops._get(cfg, "attention_bias", False))
        return _flops.dense_lm_matmul_params(cfg, qk_norm=True, attention_bias=bias)

    def vision_matmul_params(self, config: Any) -> dict[str, int]:
        """Per-patch and per-merged-token matmul parameters of the ViT (hand count; LayerNorms
        counted with weight and bias)."""
        v = _flops._get(config, "vision_config", config)
        g = lambda k: _flops._get(v, k)  # noqa: E731
        hv, iv = g("hidden_size"), g("intermediate_size")
        patch_in = g("in_channels") * g("temporal_patch_size") * g("patch_size") ** 2
        block = (3 * hv * hv + 3 * hv) + (hv * hv + hv) + (2 * hv * iv + iv + hv) + 4 * hv
        merged, out = hv * g("spatial_merge_size") ** 2, g("out_hidden_size")
        mlp = merged * merged + merged + merged * out + out
        n_deep = len(g("deepstack_visual_indexes"))
        return {
            "per_patch": patch_in * hv + hv + g("depth") * block + 2 * hv,
            "per_merged": mlp + n_deep * (mlp + 2 * merged),
        }

    def vision_flops(self, config: Any, grid_thw: Any) -> float:
        """``6·N`` per patch / merged token plus full attention over each frame's ``h·w`` patches
        in every layer."""
        v = _flops._get(config, "vision_config", config)
        merge = _flops._get(v, "spatial_merge_size")
        params = self.vision_matmul_params(config)
        total = 0.0
        for t, h, w in torch.as_tensor(grid_thw).reshape(-1, 3).tolist():
            patches = t * h * w
            total += 6.0 * (
                params["per_patch"] * patches + params["per_merged"] * patches / merge**2
            )
            total += (
                12.0
                * _flops._get(v, "hidden_size")
                * _flops._get(v, "depth")
                * t
                * float(h * w) ** 2
            )
        return total
