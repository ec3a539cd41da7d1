"""Shared logic of the Qwen-VL families (Qwen2-VL lineage): mRoPE positions, media inputs."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._attention import forward_pre_hook
from ._capabilities import TokenTypes
from ._spec import ModelSpec, to_device

__all__ = ["TINY_TOKEN_IDS", "QwenVLSpec", "tiny_qwen_vision", "vision_utils"]

#: Special token ids of the tiny presets (inside the tiny vocab of 1024). Override them with
#: ``tiny_config(image_token_id=..., ...)`` to match a locally trained tokenizer.
TINY_TOKEN_IDS = {
    "image_token_id": 1000,
    "video_token_id": 1001,
    "vision_start_token_id": 1002,
    "vision_end_token_id": 1003,
}


def tiny_qwen_vision(**overrides: Any) -> dict[str, Any]:
    """The tiny Qwen ViT shape the tiny VL presets share: 32 wide, 2 heads, 4 px patches of 2
    frames, 2x2 patches merged into one token of the tiny decoder's width (64)."""
    return {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        **overrides,
    }


_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


def merge_tiny(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``overrides``; sub-config dicts (``text_config``,
    ``vision_config``, ``audio_config``) are merged key by key. Deep: a caller may edit what it
    gets without changing the family's constant."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if key in _SUB_CONFIGS and isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


@functools.cache
def vision_utils() -> Any:
    """transformers' host-computable vision helpers (``transformers.vision_utils``), in versions
    whose vision towers take the helpers' results as keyword arguments instead of computing them
    (5.17 does: ``cu_seqlens``, ``position_ids``, ... popped from the tower's kwargs), else None."""
    try:
        from transformers import vision_utils as vu
        from transformers.utils.generic import accepts_precomputed_kwargs  # noqa: F401
    except ImportError:
        return None
    return vu


class QwenVLSpec(ModelSpec, TokenTypes):
    """Qwen-VL: ``position_ids [4, 1, T]`` (per-sample text positions, then the 3 mRoPE rows).

    Vision inputs from host grids: the towers derive rotary ids, ``cu_seqlens`` and the like from
    ``grid_thw``; from a device grid that costs host synchronisations (``.tolist()``, ``.item()``,
    ``repeat_interleave``, ...). When transformers lets a caller pass them in, the grids stay on
    the host (``host_keys``) and :meth:`media_context` hands the tower what
    :meth:`host_vision_inputs` computes there.
    """

    position_rows = 4
    #: Merge image/video features into the text embeddings at placeholder positions read on the
    #: host from ``mm_token_type_ids`` (:meth:`merge_media`) instead of upstream's
    #: ``masked_scatter``, whose count check and backward read the device. A family whose
    #: decoder needs more than ``inputs_embeds`` from the merge (Qwen3-VL's deepstack) passes it
    #: on through :meth:`media_extras`.
    host_merge: bool = False
    #: Pass the decoder only the 3 mRoPE rows of ``position_ids`` (``[3, 1, T]``), not the text
    #: row. Qwen3-VL's text model builds its causal mask from the text row, and transformers then
    #: looks for packed sequences in it and reads the answer on the host (one synchronisation per
    #: forward, for a mask varlen attention ignores); without the row it skips that, and the
    #: rotary embedding uses the mRoPE rows either way.
    mrope_rows_only: bool = False
    media_keys = (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "mm_token_type_ids",
    )

    @staticmethod
    def mm_token_type_ids(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image, 2 video, per token (what the upstream processors return)."""
        out = torch.zeros_like(input_ids, dtype=torch.int32)
        out[input_ids == config.image_token_id] = 1
        out[input_ids == config.video_token_id] = 2
        return out

    def dummy_vision_inputs(self, model: nn.Module, device: torch.device) -> dict[str, Any]:
        """The smallest valid vision-tower input: one image of one merged token (2x2 patches).

        Ranks whose pack has no media run the tower on this so FSDP's collectives stay in step
        (lmms_parallel.VisionParticipation). Keys are the tower's own forward arguments.
        """
        vc = model.config.vision_config
        merge = vc.spatial_merge_size
        chans = getattr(vc, "in_channels", getattr(vc, "in_chans", 3))
        width = chans * vc.temporal_patch_size * vc.patch_size**2
        dtype = next(self.vision_tower(model).parameters()).dtype
        return {
            "hidden_states": torch.zeros(merge * merge, width, device=device, dtype=dtype),
            "grid_thw": torch.tensor([[1, merge, merge]], device=device),
        }

    def sample_position_ids(
        self, model: nn.Module, input_ids: torch.Tensor, **media: Any
    ) -> torch.Tensor:
        """``[4, L]`` for one sample ``input_ids [L]`` through the upstream ``get_rope_index``.

        ``media``: ``image_grid_thw``, ``video_grid_thw`` (and ``second_per_grid_ts`` for
        Qwen2.5-VL video), as for the upstream model call.
        """
        ids = input_ids.reshape(1, -1)  # [1, L]
        kwargs = {k: v for k, v in media.items() if v is not None}
        if "image_grid_thw" not in kwargs and "video_grid_thw" not in kwargs:
            rows = torch.arange(ids.shape[1], device=ids.device).expand(3, -1)
        else:
            mm = self.mm_token_type_ids(model.config, ids)
            pos, _ = self.base_model(model).get_rope_index(ids, mm_token_type_ids=mm, **kwargs)
            rows = pos[:, 0]  # [3, L]
        text = torch.arange(ids.shape[1], device=ids.device)[None]
        return torch.cat([text, rows.to(text.dtype)], 0)  # [4, L]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The grids stay on the host only for a family that derives its tower's inputs there (a
        # tower handed a host grid without them would build its tensors on the host).
        if "host_vision_inputs" in cls.__dict__ and vision_utils() is not None:
            cls.host_keys = ("image_grid_thw", "video_grid_thw")
            if cls.host_merge:
                cls.host_keys += ("mm_token_type_ids",)

    def host_vision_inputs(self, tower: nn.Module, grid_thw: torch.Tensor) -> dict[str, Any]:
        """The tower's keyword arguments derived from a host ``grid_thw [n, 3]``, computed on the
        host. A family that overrides this gets ``host_keys`` set (see ``__init_subclass__``)."""
        return {}

    def merge_media(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """With ``host_merge`` and a host ``mm_token_type_ids``: run the vision tower, place its
        features at the placeholder positions with ``index_copy`` and return the call's keyword
        arguments with ``inputs_embeds`` instead of ``input_ids`` and the media.

        Same embeddings as upstream's ``masked_scatter`` path, without its host reads: upstream
        checks the placeholder count against the features on the device (and formats the count
        into its message) and its backward selects the features' gradient with ``masked_select``
        (a data-dependent size). Here the positions come from the host, are copied without
        waiting, and the backward is an ``index_select``. The count check stays, on the host.
        A family adds keyword arguments of its own from the placed features (:meth:`media_extras`).
        """
        types = inputs.get("mm_token_type_ids")
        has_media = any(inputs.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))
        if not (self.host_merge and has_media and types is not None and types.device.type == "cpu"):
            return inputs
        base = self.base_model(model)
        input_ids = inputs["input_ids"]
        embeds = base.get_input_embeddings()(input_ids)  # [1, T, H]
        types = types.reshape(-1)
        placed: list[tuple[torch.Tensor, Any]] = []
        media = (
            ("image", 1, "pixel_values", "image_grid_thw", base.get_image_features),
            ("video", 2, "pixel_values_videos", "video_grid_thw", base.get_video_features),
        )
        for kind, type_id, pixels, grid, features in media:
            if inputs.get(pixels) is None:
                continue
            out = features(inputs[pixels], inputs[grid], return_dict=True)
            feats = torch.cat(list(out.pooler_output), dim=0).to(embeds.dtype)  # [N, H]
            where = (types == type_id).nonzero().squeeze(1)  # host
            if where.numel() != feats.shape[0]:
                raise ValueError(
                    f"{kind} features and {kind} placeholder tokens do not match: "
                    f"{where.numel()} tokens, {feats.shape[0]} features"
                )
            embeds = embeds.index_copy(1, to_device(where, embeds.device), feats[None])
            placed.append((where, out))
        merged = ("input_ids", "mm_token_type_ids", "pixel_values", "pixel_values_videos",
                  "image_grid_thw", "video_grid_thw", "second_per_grid_ts")  # fmt: skip
        return {
            **{k: v for k, v in inputs.items() if k not in merged},
            "inputs_embeds": embeds,
            **self.media_extras(model, placed, embeds),
        }

    def media_extras(
        self, model: nn.Module, placed: list[tuple[torch.Tensor, Any]], embeds: torch.Tensor
    ) -> dict[str, Any]:
        """Extra keyword arguments of the base model call after :meth:`merge_media` placed the
        features (default: none). ``placed``: per media kind in merge order, the host positions
        ``[N]`` and the tower's output; ``embeds [1, T, H]``: the merged embeddings."""
        return {}

    def vision_split_plan(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Images and video temporal patches as items (:func:`lmms_models._vision_split.grid_plan`)."""
        from ._vision_split import grid_plan

        return grid_plan(self, model, args, kwargs)

    def pack_position_ids(
        self, batch: dict[str, Any], n_tokens: int, device: torch.device
    ) -> torch.Tensor:
        pos = super().pack_position_ids(batch, n_tokens, device)  # [4, 1, T]
        return pos[1:] if self.mrope_rows_only else pos

    @contextlib.contextmanager
    def media_context(self, model: nn.Module) -> Iterator[None]:
        """While active, a call of the vision tower with a host ``grid_thw`` also receives
        :meth:`host_vision_inputs`, copied to the tower's device without a synchronisation. Only
        the tower sees them (a hook on it; model keyword arguments would reach the decoder too)."""
        if not self.host_keys:
            yield
            return
        tower = self.vision_tower(model)

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if not isinstance(grid, torch.Tensor) or grid.device.type != "cpu":
                return args, kwargs
            device = (args[0] if args else kwargs["hidden_states"]).device
            extra = {
                k: to_device(v, device) if isinstance(v, torch.Tensor) else v
                for k, v in self.host_vision_inputs(tower, grid).items()
            }
            return args, {**extra, **kwargs}

        with forward_pre_hook(tower, hook):
            yield
