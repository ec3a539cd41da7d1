"""The Qwen3-VL part (``Qwen3VLForConditionalGeneration``'s layout): Qwen3 decoder with interleaved mRoPE, a ViT with
full attention everywhere and learned (interpolated) position embeddings, and *deepstack*: features
of a few ViT layers are merged and added to the hidden states of the first decoder layers at the
visual positions. The upstream model does all of that; the packed forward only feeds it, and
with host placeholder positions (``host_merge``) it merges the features itself without reading the
device: the main features by ``index_copy``, deepstack by ``index_add`` (:func:`deepstack_by_index`).

:class:`Qwen3VisionPart` is what the families with this layout compose (``qwen3_vl``,
``qwen3_vl_moe``, ``qwen3_5``, ``qwen3_5_moe``, ``qwen3_omni_moe``); its defaults are Qwen3-VL's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _flops
from .._attention import forward_pre_hook
from .._plans import QWEN3_TP_PLAN, QWEN3_VL_TP_SP_PLAN
from .._spec import to_device
from .._vl import TINY_TOKEN_IDS, QwenVLSpec, tiny_qwen_vision, vision_utils
from .text import TINY_TEXT_IDS, tiny_text

__all__ = [
    "DEEPSTACK_KEY",
    "QWEN3_VL_30B_A3B",
    "QWEN3_VL_TINY",
    "DeepstackAtPositions",
    "Qwen3VisionPart",
    "deepstack_by_index",
]

_TINY_TEXT = tiny_text(
    num_hidden_layers=3,
    head_dim=16,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
    attention_bias=False,
    **TINY_TEXT_IDS,
)
del _TINY_TEXT["tie_word_embeddings"]  # the text configs' own default (True in the MoE one)

QWEN3_VL_TINY: dict[str, Any] = {
    "text_config": _TINY_TEXT,
    "vision_config": tiny_qwen_vision(num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
    **TINY_TOKEN_IDS,
    "tie_word_embeddings": False,
}


#: Qwen3-VL-30B-A3B's shape (random weights: benchmarks and GPU examples; the ``qwen3_vl_moe``
#: preset, and the decoder and ViT of ``qwen3_omni_moe``'s). 48 decoder layers of
#: 128 experts (8 active, 768 wide), hidden 2048, 32 heads / 4 KV heads of 128; the 27-layer
#: ViT of Qwen3-VL with deepstack at layers 8, 16, 24. 31.1B parameters; 3.0B LM matmul parameters
#: active per token (lm_matmul_params).
QWEN3_VL_30B_A3B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": True,
        "router_aux_loss_coef": 0.001,
        "use_cache": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
        "in_channels": 3,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}

#: Keyword argument of the base model call carrying deepstack from :meth:`Qwen3VisionPart.merge_media`
#: to the text model: a :class:`DeepstackAtPositions`. Upstream's base model hands its unknown
#: keyword arguments on to the text model, where the hooks of :func:`deepstack_by_index` turn it
#: into upstream's arguments (after Ulysses SP's hook has cut it to the rank's slice).
DEEPSTACK_KEY = "lmms_deepstack"


@dataclass(frozen=True, slots=True)
class DeepstackAtPositions:
    """Deepstack features at the visual positions of a row of ``n_tokens`` tokens.

    ``where``: ``[N]`` long positions (host, from the host merge) or a boolean ``[1, T]`` mask
    (upstream's own merge); ``feats``: one ``[N, H]`` tensor per deepstack layer, in position
    order. ``sp_slice`` is lmms_parallel.SequenceParallel's protocol: the rank's token range
    ``[start, stop)`` keeps the positions inside it (shifted to the slice) and their features, so
    deepstack follows the row's slicing exactly. Host positions are cut on the host (no device
    read); a device mask costs one read of its prefix count.
    """

    where: torch.Tensor
    feats: list[torch.Tensor]
    n_tokens: int

    def sp_slice(self, start: int, stop: int) -> DeepstackAtPositions:
        if self.where.dtype == torch.bool:  # [1, T] mask: visual tokens before / inside the slice
            mask = self.where.reshape(-1)
            counts = torch.stack([mask[:start].sum(), mask[start:stop].sum()]).tolist()
            first, n = int(counts[0]), int(counts[1])
            cut = mask[start:stop]
            if cut.numel() < stop - start:  # the SP padding tail has no visual token
                cut = torch.cat([cut, cut.new_zeros(stop - start - cut.numel())])
            feats = [f[first : first + n] for f in self.feats]
            return DeepstackAtPositions(cut[None], feats, stop - start)
        keep = ((self.where >= start) & (self.where < stop)).nonzero().squeeze(1)  # [n]
        if keep.numel() == self.where.numel():
            return DeepstackAtPositions(self.where - start, self.feats, stop - start)
        feats = [f.index_select(0, to_device(keep, f.device)) for f in self.feats]
        return DeepstackAtPositions(self.where[keep] - start, feats, stop - start)


def _deepstack_features(out: Any) -> list[torch.Tensor]:
    """The tower output's deepstack features as one ``[N, H]`` tensor per layer (transformers
    5.17 keeps them whole; later versions split them per image like ``pooler_output``)."""
    feats = out.deepstack_features or []
    return [f if isinstance(f, torch.Tensor) else torch.cat(list(f), dim=0) for f in feats]


@contextlib.contextmanager
def deepstack_by_index(text_model: nn.Module) -> Iterator[None]:
    """While active, the Qwen3-VL text model takes deepstack as a :class:`DeepstackAtPositions`
    that follows any slicing of the row (Ulysses SP), and adds host positions by index.

    Two hooks on the text model, around any other pre-hook (SequenceParallel's included, however
    early it was installed): the first (prepended) wraps upstream's own ``visual_pos_masks`` /
    ``deepstack_visual_embeds`` as a ``DEEPSTACK_KEY`` too, so that a slicing hook cuts either
    form; the last unwraps ``DEEPSTACK_KEY`` into upstream's arguments for the (sliced) row.
    With integer positions the instance's ``_deepstack_process`` adds a layer's features with
    ``index_add``. Upstream indexes with the boolean mask (``hidden[mask] + embeds``, written
    back): a ``nonzero`` whose size the host must read, forward and backward. Each visual
    position gets the same single addition (bit-identical); the backward is an
    ``index_select``. Boolean masks (upstream's own merge) still take upstream's path. Removed
    on exit. An adder already on the instance that takes positions too (lmms_parallel's
    ``sp_deepstack`` TP style: the residual stream split over the sequence, each rank adding the
    positions inside its rows) stays in place.
    """
    upstream = text_model._deepstack_process

    def process(hidden: torch.Tensor, where: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        if where.dtype == torch.bool:
            return upstream(hidden, where, embeds)
        # hidden [1, T, H], where [N], embeds [N, H]
        return hidden.index_add(1, where, embeds.to(hidden.device, hidden.dtype)[None])

    def wrap(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask, feats = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
        if DEEPSTACK_KEY in kwargs or mask is None or feats is None:
            return args, kwargs
        kwargs = {k: v for k, v in kwargs.items() if k not in ("visual_pos_masks",
                                                               "deepstack_visual_embeds")}  # fmt: skip
        kwargs[DEEPSTACK_KEY] = DeepstackAtPositions(mask, list(feats), mask.shape[-1])
        return args, kwargs

    def unwrap(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        deep = kwargs.pop(DEEPSTACK_KEY, None)
        if deep is None:
            return args, kwargs
        embeds = kwargs.get("inputs_embeds")
        if embeds is None or embeds.shape[1] != deep.n_tokens:
            raise RuntimeError(
                f"Qwen3-VL deepstack positions index a row of {deep.n_tokens} tokens, the text "
                f"model got {None if embeds is None else embeds.shape[1]}: a hook sliced the row "
                "without cutting the deepstack positions (give the value an sp_slice method, as "
                "lmms_parallel.SequenceParallel expects)"
            )
        where = to_device(deep.where, embeds.device)
        return args, {**kwargs, "visual_pos_masks": where, "deepstack_visual_embeds": deep.feats}

    own = vars(text_model).get("_deepstack_process")  # an instance patch already there, if any
    keep = getattr(own, "takes_positions", False)  # e.g. lmms_parallel's sp_deepstack
    if not keep:
        text_model._deepstack_process = process
    first = text_model.register_forward_pre_hook(wrap, with_kwargs=True, prepend=True)
    try:
        with forward_pre_hook(text_model, unwrap):
            yield
    finally:
        first.remove()
        if keep:
            pass  # not ours to remove
        elif own is None:
            del text_model._deepstack_process
        else:
            text_model._deepstack_process = own


class Qwen3VisionPart(QwenVLSpec):
    """The Qwen3-VL ViT (learned interpolated positions, deepstack at host positions, its SP
    style) on a Qwen3 decoder with interleaved mRoPE. The family states its names: processor,
    Liger plan, config/model classes, presets, tiny config."""

    tp_plan = QWEN3_TP_PLAN
    tp_sp_plan = QWEN3_VL_TP_SP_PLAN  # + sp_deepstack: deepstack on each rank's rows
    mrope_rows_only = True  # its text model's mask preparation reads the text row on the host
    host_merge = True  # deepstack too: media_extras + deepstack_by_index

    def plan_styles(self) -> dict[str, Any]:
        """``sp_deepstack`` (``tp_sp_plan``): deepstack added on each rank's rows."""
        from .qwen3_deepstack_sp import SeqShardedDeepstack

        return {"sp_deepstack": lambda mesh: SeqShardedDeepstack(mesh.get_group())}

    def media_extras(
        self, model: nn.Module, placed: list[tuple[torch.Tensor, Any]], embeds: torch.Tensor
    ) -> dict[str, Any]:
        """Deepstack at the placed positions: per layer, the features of every kind in merge
        order (images, then videos) at the matching host positions, copied without waiting."""
        if not placed:
            return {}
        where = torch.cat([w for w, _ in placed])  # [N] host
        per_kind = [_deepstack_features(out) for _, out in placed]
        feats = [torch.cat(layer, dim=0) for layer in zip(*per_kind, strict=True)]
        return {DEEPSTACK_KEY: DeepstackAtPositions(where, feats, embeds.shape[1])}

    @contextlib.contextmanager
    def media_context(self, model: nn.Module) -> Iterator[None]:
        """The tower hook of :class:`QwenVLSpec` and :func:`deepstack_by_index` on the text model."""
        with super().media_context(model), deepstack_by_index(self.text_model(model)):
            yield

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
            total += _flops.vit_matmul_flops(params, t * h * w, merge)
            total += (
                12.0
                * _flops._get(v, "hidden_size")
                * _flops._get(v, "depth")
                * t
                * float(h * w) ** 2
            )
        return total
