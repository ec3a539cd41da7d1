"""The Qwen2.5-VL part (``Qwen2_5_VLForConditionalGeneration``'s layout): Qwen2.5 decoder with 3-D mRoPE, and a
SwiGLU/RMSNorm ViT that uses windowed attention (112 px windows) in all but a few full-attention
layers, then merges 2×2 patches into one LM token. :class:`Qwen2_5VisionPart` is what the ``qwen2_5_vl`` and
``qwen2_5_omni`` families compose; its defaults are Qwen2.5-VL's."""

from __future__ import annotations

from typing import Any

import torch

from .. import _flops
from .._plans import QWEN2_TP_PLAN, QWEN2_TP_SP_PLAN
from .._vl import TINY_TOKEN_IDS, QwenVLSpec, tiny_qwen_vision, vision_utils
from .text import TINY_TEXT_IDS, tiny_text

__all__ = [
    "QWEN2_5_VL_3B",
    "QWEN2_5_VL_TINY",
    "Qwen2_5VisionPart",
    "precomputed_vision_inputs",
    "vit_tower_shape",
]

# Published Qwen2.5-VL-3B-Instruct config values (random weights are used for benchmarks).
QWEN2_5_VL_3B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [16, 24, 24],
        },
        "tie_word_embeddings": True,
        "use_cache": False,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "hidden_act": "silu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "in_channels": 3,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
}

QWEN2_5_VL_TINY: dict[str, Any] = {
    "text_config": tiny_text(
        rms_norm_eps=1e-5,  # Qwen2.5-VL's text config default
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        **TINY_TEXT_IDS,
    ),
    "vision_config": tiny_qwen_vision(
        window_size=16,  # 2x2 merged tokens per window: real windowing at tiny sizes
        fullatt_block_indexes=[1],
    ),
    **TINY_TOKEN_IDS,
    "tie_word_embeddings": False,
}


def precomputed_vision_inputs(vision_config: Any, grid_thw: torch.Tensor) -> dict[str, Any]:
    """What Qwen2.5-VL's vision tower derives from ``grid_thw [n, 3]`` before its blocks, computed
    here on the host by transformers' own helpers: rotary position ids, per-frame and per-window
    ``cu_seqlens`` with their maxima, and the window permutation. Given a CUDA ``grid_thw``
    the tower computes them itself with ~10 host synchronisations (``.tolist()``, ``.item()``,
    ``repeat_interleave``, ``unique_consecutive``, indexing with host indices); from a host grid
    they cost none. Keys are the tower's keyword arguments.
    """
    vu = vision_utils()
    grid = grid_thw.reshape(-1, 3).cpu()
    merge = vision_config.spatial_merge_size
    cu = vu.get_vision_cu_seqlens(grid)
    window_index, cu_window = vu.get_vision_window_index(
        grid,
        spatial_merge_size=merge,
        window_size=vision_config.window_size,
        patch_size=vision_config.patch_size,
    )
    return {
        "position_ids": vu.get_vision_position_ids(grid, merge),
        "cu_seqlens": cu,
        "max_seqlen": int((cu[1:] - cu[:-1]).max()),
        "window_index": window_index,
        "cu_window_seqlens": cu_window,
        "max_window_seqlen": int((cu_window[1:] - cu_window[:-1]).max()),
    }


def vit_tower_shape(config: Any) -> Any:
    """The memory planner's view of a Qwen-VL ViT (``vision_config``'s depth, width, MLP width and
    heads): a SwiGLU MLP, ``spatial_merge_size²`` patches per image token."""
    from .._memory import TowerShape

    v = _flops._get(config, "vision_config", config)
    g = lambda k: _flops._get(v, k)  # noqa: E731
    return TowerShape(
        layers=g("depth"), hidden=g("hidden_size"), intermediate=g("intermediate_size"),
        heads=g("num_heads"), kv_heads=g("num_heads"), head_dim=g("hidden_size") // g("num_heads"),
        tokens_per_media_token=float(g("spatial_merge_size") ** 2),
    )  # fmt: skip


class Qwen2_5VisionPart(QwenVLSpec):
    """Qwen2.5-VL's windowed ViT (host-precomputed windows, hand-counted FLOPs and memory) on
    a Qwen2 decoder with 3-D mRoPE (TP plans, the prepared mask mapping, host merge). The family
    states its names: processor, Liger plan, config/model classes, presets, tiny config."""

    tp_plan = QWEN2_TP_PLAN
    tp_sp_plan = QWEN2_TP_SP_PLAN
    mask_mapping = True  # upstream decoder: `isinstance(attention_mask, dict)` branch
    host_merge = True

    def host_vision_inputs(self, tower: Any, grid_thw: torch.Tensor) -> dict[str, Any]:
        return precomputed_vision_inputs(tower.config, grid_thw)

    def vision_matmul_params(self, config: Any) -> dict[str, int]:
        """Per-patch and per-merged-token matmul parameters of the ViT (hand count)."""
        v = _flops._get(config, "vision_config", config)
        g = lambda k: _flops._get(v, k)  # noqa: E731
        hv, iv = g("hidden_size"), g("intermediate_size")
        patch_in = g("in_channels") * g("temporal_patch_size") * g("patch_size") ** 2
        block = (3 * hv * hv + 3 * hv) + (hv * hv + hv) + (3 * hv * iv + 2 * iv + hv) + 2 * hv
        merged = hv * g("spatial_merge_size") ** 2
        merger = merged * merged + merged + merged * g("out_hidden_size") + g("out_hidden_size")
        return {"per_patch": patch_in * hv + g("depth") * block + hv, "per_merged": merger}

    def memory_towers(self, config: Any) -> dict[str, Any]:
        """The decoder and the ViT (:func:`vit_tower_shape`)."""
        return {**super().memory_towers(config), "vision": vit_tower_shape(config)}

    def vision_flops(self, config: Any, grid_thw: Any) -> float:
        """``6·N`` per patch (blocks, patch embed) and per merged token (merger), plus attention:
        full layers over each frame's ``h·w`` patches, window layers over the windows that
        upstream's ``get_vision_window_index`` cuts (``window_size`` px, edge windows partial)."""
        v = _flops._get(config, "vision_config", config)
        g = lambda k: _flops._get(v, k)  # noqa: E731
        merge = g("spatial_merge_size")
        win = g("window_size") // merge // g("patch_size")  # window side in merged tokens
        n_full = len(g("fullatt_block_indexes"))
        n_win = g("depth") - n_full
        params = self.vision_matmul_params(config)
        total = 0.0
        for t, h, w in torch.as_tensor(grid_thw).reshape(-1, 3).tolist():
            total += _flops.vit_matmul_flops(params, t * h * w, merge)
            a2 = sum(x * x for x in _flops.window_lengths(h // merge, win))
            b2 = sum(x * x for x in _flops.window_lengths(w // merge, win))
            sq_full = t * float(h * w) ** 2
            sq_win = t * float(a2 * b2) * merge**4
            total += 12.0 * g("hidden_size") * (n_full * sq_full + n_win * sq_win)
        return total
