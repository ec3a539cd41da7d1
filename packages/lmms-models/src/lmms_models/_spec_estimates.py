"""The FLOPs and memory estimates of a :class:`lmms_models.ModelSpec` (what the trainer's MFU and
``lmms-train plan`` read): a base of ``ModelSpec``, so every family answers them with these
defaults (a dense decoder's ``6N`` + attention, media towers from their grids) and overrides
what differs (MoE: active experts; linear attention; BAGEL counts from its pack).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from . import _flops

__all__ = ["SpecEstimates"]


class SpecEstimates:
    """FLOPs (:meth:`lm_flops`, :meth:`media_flops`, :meth:`pack_flops`) and memory-plan
    (:meth:`memory_towers`) hooks of :class:`lmms_models.ModelSpec`, with their defaults; they
    read the family's ``text_config`` (``ModelSpec.text_config``)."""

    # ---------------------------------------------------------------- FLOPs
    def lm_matmul_params(self, config: Any) -> int:
        """Parameters in a matmul per token (see :mod:`lmms_models._flops`)."""
        return _flops.dense_lm_matmul_params(self.text_config(config))

    def lm_flops(self, config: Any, seq_lens: Sequence[int], *, causal_half: bool = False) -> float:
        """Training FLOPs of the language model on segments ``seq_lens``: ``6·N·Σs + attention``."""
        cfg = self.text_config(config)
        n_layers = _flops._get(cfg, "num_hidden_layers")
        width = _flops._get(cfg, "num_attention_heads") * _flops.head_dim(cfg)
        dense = 6.0 * self.lm_matmul_params(config) * sum(seq_lens)
        return dense + _flops.attention_flops(n_layers, width, seq_lens, causal_half=causal_half)

    def lm_flops_per_token(
        self, config: Any, seq_lens: Sequence[int], *, causal_half: bool = False
    ) -> float:
        """:meth:`lm_flops` divided by the number of tokens."""
        return self.lm_flops(config, seq_lens, causal_half=causal_half) / max(1, sum(seq_lens))

    def vision_flops(self, config: Any, grid_thw: Any) -> float:
        """Training FLOPs of the vision tower for images/videos of ``grid_thw [n, 3]``."""
        return 0.0

    def pack_vision_flops(self, config: Any, batch: dict[str, Any]) -> float:
        """Vision FLOPs of a packed batch (default: :meth:`vision_flops` of its image and video
        grids; a family whose media carry no grid, e.g. LLaVA-OneVision's tiles, overrides)."""
        total = 0.0
        for key in ("image_grid_thw", "video_grid_thw"):
            grid = batch.get(key)
            if grid is not None and len(grid):
                total += float(self.vision_flops(config, grid))
        return total

    def media_flops(self, config: Any, batch: dict[str, Any]) -> float:
        """Training FLOPs of the media towers on a packed batch (what MFU adds to the LM's):
        :meth:`pack_vision_flops`; audio families add their encoder."""
        return self.pack_vision_flops(config, batch)

    def pack_flops(
        self, config: Any, batch: dict[str, Any], lens: Sequence[int] | None = None
    ) -> tuple[float, ...]:
        """Training FLOPs of one packed batch with segments ``lens`` (default: from its
        ``cu_seqlens``), what the trainer's MFU reads: ``(LM, media, LM with causal attention
        halved, LM-head FLOPs not run)``; the last is the head's ``6·H·V`` for every token the
        head skipped (the batch's ``loss_rows`` hold the rows run). A family that counts from
        the pack itself (BAGEL: its mask and experts) returns ``(decoder, media)``."""
        if lens is None:
            cu = batch["cu_seqlens"].tolist()
            lens = [b - a for a, b in itertools.pairwise(cu)]
        lm = float(self.lm_flops(config, lens))
        half = float(self.lm_flops(config, lens, causal_half=True))
        skipped = 0.0
        rows = batch.get("loss_rows")
        if rows is not None:
            text = self.text_config(config)
            head = 6.0 * float(text.hidden_size) * float(text.vocab_size)
            skipped = head * max(0, sum(lens) - len(rows))
        return lm, float(self.media_flops(config, batch)), half, skipped

    # ---------------------------------------------------------------- memory plan
    def memory_towers(self, config: Any) -> dict[str, Any]:
        """``{tower: lmms_models.TowerShape}`` for the memory plan (``lmms-train plan``): the
        decoder from the text config by default; a family with a vision or audio tower adds it
        under the name its blocks are checkpointed by (``"vision"``). Raises NotImplementedError
        where the family's blocks are not of that shape (the plan then says so)."""
        from ._memory import decoder_tower

        return {"decoder": decoder_tower(self.text_config(config))}
