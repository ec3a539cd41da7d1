"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): a SigLIP ViT, a 2-layer GELU
projector and a Qwen2 decoder.

Images are tiled "anyres-max": a base 384 px view plus the tiles of the best grid pinpoint; the
tiles' features are unpadded to the image's aspect ratio, shrunk when they exceed ``max_9``
tiles' worth, and each feature row ends with the learned ``image_newline``. Images of a
multi-image sample keep the base view only (plus one newline). Video frames are single views,
2x2 bilinear-pooled, with one newline after the whole video. All of that stays upstream: the
packed forward calls the base model's ``get_image_features`` (every tile of every image of the
pack in one tower call) and ``get_video_features`` (every frame of the pack in one call; frames
are independent, so only the newline per video is placed here), then places the features at
host-known placeholder positions (``index_copy``; no ``masked_scatter`` device reads).

The SigLIP tower attends within each tile/frame: with an lmms varlen backend its attention gets
the tiles as one segment each (the registered function's per-row segments), i.e. one varlen call
over every tile and frame of the pack.

Batch media (lmms-data's ``llava_onevision`` processor, concatenated in pack order):
``pixel_values [tiles, C, S, S]``, ``image_sizes [images, 2]``, ``batch_num_images [samples with
images]``, ``pixel_values_videos [frames, C, S, S]``, ``video_frames [videos]``,
``mm_token_type_ids [T]`` (0 text, 1 image, 2 video). The sizes and counts stay on the host.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ... import _flops
from ..._capabilities import OwnTestSamples, TokenTypes
from ..._registry import register_model
from ..._spec import ModelSpec, to_device
from ..._vl import merge_tiny
from ...parts.text import QWEN2_LIGER_PLAN, TINY_TEXT_IDS, tiny_text

__all__ = ["LLAVA_ONEVISION_0_5B", "LLAVA_ONEVISION_7B", "LlavaOnevisionSpec"]

#: anyres grid pinpoints of the released checkpoints: 384 px tiles, 1..6 per side
_PINPOINTS = [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)]

_SIGLIP_SO400M: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 26,
    "num_attention_heads": 16,
    "image_size": 384,
    "patch_size": 14,
    "vision_use_head": False,
}


def _preset(text: dict[str, Any]) -> dict[str, Any]:
    return {
        "text_config": {
            "model_type": "qwen2",
            "vocab_size": 152000,
            "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "use_cache": False,
            **text,
        },
        "vision_config": dict(_SIGLIP_SO400M),
        "image_token_id": 151646,
        "video_token_id": 151647,
        "image_grid_pinpoints": _PINPOINTS,
        "vision_aspect_ratio": "anyres_max_9",
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
    }


# Published llava-onevision-qwen2-{0.5b,7b}-ov shapes (random weights are used for benchmarks).
LLAVA_ONEVISION_0_5B = _preset(
    {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
     "num_attention_heads": 14, "num_key_value_heads": 2}
)  # fmt: skip
LLAVA_ONEVISION_7B = _preset(
    {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152128}
)  # fmt: skip

#: Tiny: 32 px tiles of 8 px patches (16 patches, 4 pooled per video frame), pinpoints up to 3x3
#: tiles, token ids inside the vocab of 1024 (override them to match a local tokenizer).
_TINY: dict[str, Any] = {
    "text_config": tiny_text(model_type="qwen2", **TINY_TEXT_IDS),
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
        "vision_use_head": False,
    },
    "image_token_id": 1000,  # LlavaOnevisionConfig maps *_token_id to *_token_index
    "video_token_id": 1001,
    "image_grid_pinpoints": [[32 * a, 32 * b] for a in range(1, 4) for b in range(1, 4)],
    "vision_aspect_ratio": "anyres_max_4",
    "vision_feature_select_strategy": "full",
    "vision_feature_layer": -1,
    "tie_word_embeddings": False,
}

_MEDIA_KEYS = ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos",
               "video_frames", "mm_token_type_ids")  # fmt: skip


@register_model("llava_onevision")
class LlavaOnevisionSpec(ModelSpec, TokenTypes, OwnTestSamples):
    engine_model_types = {"llava_video": None}  # noqa: RUF012 (lmms-engine LLaVA-Video)
    engine_dataset_types = ("llava_video",)
    processor_family = "llava_onevision"
    liger_plan = QWEN2_LIGER_PLAN  # SigLIP's LayerNorm and GELU MLP stay upstream
    config_class = "LlavaOnevisionConfig"
    model_class = "LlavaOnevisionForConditionalGeneration"
    mask_mapping = True  # Qwen2 decoder: `isinstance(attention_mask, dict)` branch
    media_keys = _MEDIA_KEYS
    host_keys = ("image_sizes", "batch_num_images", "video_frames", "mm_token_type_ids")
    presets = {"0.5b": LLAVA_ONEVISION_0_5B, "7b": LLAVA_ONEVISION_7B}  # noqa: RUF012

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        return merge_tiny(_TINY, overrides)

    def build(self, **kwargs: Any) -> nn.Module:
        """:meth:`ModelSpec.build`; on the meta device SigLIP's non-persistent ``position_ids``
        buffer (``arange`` over the view's patches) is made real again, so that
        lmms_parallel.materialize keeps it (it cannot recompute buffers it does not know).

        SigLIP's ``post_layernorm`` is frozen: LLaVA-OneVision reads the tower's
        ``hidden_states[vision_feature_layer]``, which come before that norm, so it never gets a
        gradient; left trainable, the optimizer would hold no state for it and a resumed run's
        fresh optimizer (which has state for every trainable parameter) could not load the
        checkpoint. Its weights are still loaded and exported unchanged."""
        model = super().build(**kwargs)
        tower = self.vision_tower(model)
        vision = getattr(tower, "vision_model", tower)
        emb = vision.embeddings
        if emb.position_ids.is_meta:
            ids = torch.arange(emb.num_positions).expand((1, -1))
            emb.register_buffer("position_ids", ids, persistent=False)
        post = getattr(vision, "post_layernorm", None)
        if post is not None:
            post.requires_grad_(False)
        return model

    # ---------------------------------------------------------------- layout
    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return self.base_model(model).vision_tower

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        tower = self.base_model(model).vision_tower  # SiglipVisionModel (5.17: .vision_model)
        return list(getattr(tower, "vision_model", tower).encoder.layers)

    def dummy_vision_inputs(self, model: nn.Module, device: torch.device) -> dict[str, Any]:
        """One view of zeros (the tower's ``pixel_values [1, C, S, S]``), with the hidden states
        the media path reads (:meth:`vision_participation_outputs`)."""
        vc = model.config.vision_config
        dtype = next(self.vision_tower(model).parameters()).dtype
        size = vc.image_size
        pixels = torch.zeros(1, vc.num_channels, size, size, device=device, dtype=dtype)
        return {"pixel_values": pixels, "output_hidden_states": True}

    def vision_participation_outputs(self, model: nn.Module, out: Any) -> list[torch.Tensor]:
        """The projector on the feature layer(s) and the newline: what images and videos reach
        outside the tower (and not the tower's final LayerNorm, which the media path skips)."""
        base = self.base_model(model)
        layer = model.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return [base.multi_modal_projector(feats), base.image_newline]

    def vision_split_plan(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Views (image tiles, video frames) as items for lmms_parallel.SplitVision: equal FLOPs
        each; only the feature layer(s) of the hidden states are gathered."""
        from lmms_parallel import VisionSplitPlan

        pixels = args[0] if args else kwargs["pixel_values"]  # [views, C, S, S]
        rest = {k: v for k, v in kwargs.items() if k != "pixel_values"}
        layer = model.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)

        def keep(out: Any) -> Any:
            states = out.hidden_states
            wanted = {i % len(states) for i in layers}
            kept = tuple(h if i in wanted else None for i, h in enumerate(states))
            return type(out)(hidden_states=kept)

        def dummy() -> tuple[tuple, dict[str, Any]]:
            return (torch.zeros_like(pixels[:1]),), rest

        return VisionSplitPlan(
            units=[1] * pixels.shape[0],
            costs=[float(self.vision_flops(model.config, 1))] * pixels.shape[0],
            call=lambda lo, hi: ((pixels[lo:hi],), rest),
            dummy=dummy,
            dummy_units=1,
            keep=keep,
        )

    def media_inputs(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        out = super().media_inputs(batch, device)
        if "mm_token_type_ids" in out:
            out["mm_token_type_ids"] = out["mm_token_type_ids"].reshape(-1)
        return out

    # ---------------------------------------------------------------- merge
    def merge_media(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Features of every image and video of the pack from upstream's ``get_image_features``
        / ``get_video_features``, placed at the placeholder positions; returns the base model
        call's keyword arguments with ``inputs_embeds`` and no media.

        Positions come from the host ``mm_token_type_ids`` (without it: from ``input_ids``, one
        device read). A placeholder count that differs from the features is refused.
        """
        inputs = dict(inputs)
        media = {k: inputs.pop(k, None) for k in _MEDIA_KEYS}
        input_ids = inputs.pop("input_ids")
        base = self.base_model(model)
        embeds = base.get_input_embeddings()(input_ids)  # [1, T, H]
        if media["pixel_values"] is None and media["pixel_values_videos"] is None:
            return {**inputs, "inputs_embeds": embeds}
        types = media["mm_token_type_ids"]
        if types is None:
            cfg = model.config
            types = (input_ids == cfg.image_token_index).long() + 2 * (
                input_ids == cfg.video_token_index
            ).long()
        types = types.reshape(-1).cpu()
        for kind, type_id, feats in (
            ("image", 1, self._image_features(base, media)),
            ("video", 2, self._video_features(base, media)),
        ):
            if feats is None:
                continue
            where = (types == type_id).nonzero().squeeze(1)  # host
            if where.numel() != feats.shape[0]:
                raise ValueError(
                    f"{kind} features and {kind} placeholder tokens do not match: "
                    f"{where.numel()} tokens, {feats.shape[0]} features"
                )
            where = to_device(where, embeds.device)
            embeds = embeds.index_copy(1, where, feats.to(embeds.dtype)[None])
        return {**inputs, "inputs_embeds": embeds}

    @staticmethod
    def _image_features(base: nn.Module, media: dict[str, Any]) -> torch.Tensor | None:
        pixels = media["pixel_values"]
        if pixels is None:
            return None
        sizes = media["image_sizes"]
        counts = media["batch_num_images"]
        if counts is None:  # one image per sample
            counts = torch.ones(sizes.shape[0], dtype=torch.long)
        out = base.get_image_features(
            pixels, sizes.cpu(), batch_num_images=counts.cpu().tolist(), return_dict=True
        )
        return torch.cat(list(out.pooler_output), dim=0)  # [N, H]

    @staticmethod
    def _video_features(base: nn.Module, media: dict[str, Any]) -> torch.Tensor | None:
        """Every frame of the pack through one ``get_video_features`` call (one "video" of all
        frames: frames are pooled independently), then upstream's trailing newline placed after
        each video's frames."""
        pixels = media["pixel_values_videos"]
        if pixels is None:
            return None
        out = base.get_video_features(pixels[None], return_dict=True)
        pooled = out.pooler_output[0]  # [frames * tokens (+ 1), H]
        frames = media["video_frames"]
        frames = [pixels.shape[0]] if frames is None else frames.reshape(-1).tolist()
        per_frame = LlavaOnevisionSpec.pooled_frame_tokens(base.config)
        # newer transformers append the newline row (`image_newline`) to get_video_features'
        # output; 5.17 (the GPU image) appends it in the model's forward: take it from the model
        newline = base.image_newline[None].to(pooled)
        parts, start = [], 0
        for n in frames:
            parts += [pooled[start : start + n * per_frame], newline]
            start += n * per_frame
        return torch.cat(parts)  # [N, H]

    # ---------------------------------------------------------------- FLOPs
    def lm_matmul_params(self, config: Any) -> int:
        return _flops.dense_lm_matmul_params(self.text_config(config))

    def vision_matmul_params(self, config: Any) -> dict[str, int]:
        """Matmul parameters per patch (SigLIP: patch embedding, blocks with biases and
        LayerNorms, post-LayerNorm) and per projected token (the 2-layer projector)."""
        v = _flops._get(config, "vision_config")
        g = lambda k: _flops._get(v, k)  # noqa: E731
        hv, iv = g("hidden_size"), g("intermediate_size")
        block = 4 * hv * hv + 4 * hv + 2 * hv * iv + iv + hv + 4 * hv
        patch_in = _flops._get(v, "num_channels", 3) * g("patch_size") ** 2
        ht = _flops._get(self.text_config(config), "hidden_size")
        projector = hv * ht + ht + ht * ht + ht
        return {
            "per_patch": patch_in * hv + hv + g("num_hidden_layers") * block + 2 * hv,
            "per_token": projector,
        }

    def memory_towers(self, config: Any) -> dict[str, Any]:
        """The decoder and SigLIP (plain GELU MLP; about one patch per image token: each tile's
        patches become its tokens, unpadded; videos pool 2x2 and take fewer)."""
        from ..._memory import TowerShape

        v = _flops._get(config, "vision_config")
        g = lambda k: _flops._get(v, k)  # noqa: E731
        heads = g("num_attention_heads")
        vision = TowerShape(
            layers=g("num_hidden_layers"), hidden=g("hidden_size"),
            intermediate=g("intermediate_size"), heads=heads, kv_heads=heads,
            head_dim=g("hidden_size") // heads, gated_mlp=False, tokens_per_media_token=1.0,
        )  # fmt: skip
        return {**super().memory_towers(config), "vision": vision}

    def vision_flops(self, config: Any, grid_thw: Any) -> float:
        """FLOPs of ``tiles`` SigLIP views (an int or a tensor of per-image tile counts; the
        grid argument of the Qwen-VL families): ``6·N`` per patch and per projected token plus
        full attention over each tile's patches in every layer (the position embedding is a
        lookup)."""
        v = _flops._get(config, "vision_config")
        tiles = float(torch.as_tensor(grid_thw).sum())
        patches = (_flops._get(v, "image_size") // _flops._get(v, "patch_size")) ** 2
        params = self.vision_matmul_params(config)
        dense = 6.0 * tiles * patches * (params["per_patch"] + params["per_token"])
        attn = 12.0 * _flops._get(v, "hidden_size") * _flops._get(v, "num_hidden_layers")
        return dense + attn * tiles * float(patches) ** 2

    def pack_vision_flops(self, config: Any, batch: dict[str, Any]) -> float:
        """Vision FLOPs of a packed batch: every image tile and video frame."""
        tiles = sum(
            int(batch[k].shape[0])
            for k in ("pixel_values", "pixel_values_videos")
            if batch.get(k) is not None
        )
        return self.vision_flops(config, tiles) if tiles else 0.0

    # ---------------------------------------------------------------- tests (lmms_models.testing)
    @staticmethod
    def mm_token_type_ids(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image, 2 video, per token (what lmms-data's processor emits)."""
        out = torch.zeros_like(input_ids)
        out[input_ids == config.image_token_index] = 1
        out[input_ids == config.video_token_index] = 2
        return out

    @staticmethod
    def image_tiles(config: Any, image_size: tuple[int, int], *, multi: bool) -> int:
        """Views of one image: base + anyres tiles (upstream's count); 1 in a multi-image sample."""
        from transformers.models.llava_onevision import modeling_llava_onevision as upstream

        if multi:
            return 1
        size = config.vision_config.image_size
        return upstream.image_size_to_num_patches(
            list(image_size), config.image_grid_pinpoints, size
        )

    @staticmethod
    def image_tokens(config: Any, image_size: tuple[int, int], *, multi: bool) -> int:
        """Placeholder tokens of one image as upstream's ``pack_image_features`` lays them out
        (run on zero features of the right shape: the count, not a re-derivation of it)."""
        from transformers.models.llava_onevision import modeling_llava_onevision as upstream

        v = config.vision_config
        side = v.image_size // v.patch_size
        tiles = LlavaOnevisionSpec.image_tiles(config, image_size, multi=multi)
        owner = type("Config", (), {"config": config})()
        _, lens = upstream.LlavaOnevisionModel.pack_image_features(
            owner, [torch.zeros(tiles, side * side, 1)], torch.tensor([list(image_size)]),
            image_newline=torch.zeros(1), vision_aspect_ratio=config.vision_aspect_ratio,
        )  # fmt: skip
        return int(lens[0])

    def make_test_sample(self, config: Any, s: Any, *, gen: torch.Generator) -> dict[str, Any]:
        """A synthetic sample for lmms_models.testing: ``s.images`` ``(t, h, w)`` become images of
        ``(8h+5) x (8w+3)`` px (anyres tiles; base view only when a sample has several),
        ``s.videos`` ``(t, h, w)`` videos of ``t`` frames."""
        from ..._spec import IGNORE_INDEX

        v = config.vision_config
        low = min(config.image_token_index, config.video_token_index)
        rand = lambda n: torch.randint(0, low, (n,), generator=gen).tolist()  # noqa: E731
        tile = (v.num_channels, v.image_size, v.image_size)
        ids: list[int] = []
        out: dict[str, Any] = {}
        sizes = [(8 * h + 5, 8 * w + 3) for _, h, w in s.images]
        multi = len(sizes) > 1
        tiles = []
        for size in sizes:
            n_tokens = self.image_tokens(config, size, multi=multi)
            ids += rand(2) + [config.image_token_index] * n_tokens
            n = self.image_tiles(config, size, multi=multi)
            tiles.append(torch.randn(n, *tile, generator=gen))
        if sizes:
            out["pixel_values"] = torch.cat(tiles)
            out["image_sizes"] = torch.tensor(sizes, dtype=torch.long)
            out["batch_num_images"] = torch.tensor([len(sizes)])
        frames = [t for t, _, _ in s.videos]
        for t in frames:
            ids += rand(1) + [config.video_token_index] * (t * self.pooled_frame_tokens(config) + 1)
        if frames:
            out["pixel_values_videos"] = torch.randn(sum(frames), *tile, generator=gen)
            out["video_frames"] = torch.tensor(frames)
        ids += rand(s.text)
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        labels[: s.prompt] = IGNORE_INDEX
        labels[self.mm_token_type_ids(config, input_ids) != 0] = IGNORE_INDEX
        return {**out, "input_ids": input_ids, "labels": labels}

    @staticmethod
    def reference_media(sample: dict[str, Any]) -> dict[str, Any]:
        """The upstream call's media arguments for one sample (its videos must share a frame
        count: upstream stacks them ``[videos, frames, C, S, S]``)."""
        out = {k: sample[k] for k in ("pixel_values", "image_sizes") if k in sample}
        if "batch_num_images" in sample:
            out["batch_num_images"] = sample["batch_num_images"].tolist()
        if "pixel_values_videos" in sample:
            pv, frames = sample["pixel_values_videos"], sample["video_frames"]
            out["pixel_values_videos"] = pv.reshape(len(frames), -1, *pv.shape[1:])
        return out

    @staticmethod
    def pooled_frame_tokens(config: Any) -> int:
        """Tokens per video frame after the 2x2 bilinear pooling."""
        v = _flops._get(config, "vision_config")
        side = _flops._get(v, "image_size") // _flops._get(v, "patch_size")
        return math.ceil(side / 2) ** 2
