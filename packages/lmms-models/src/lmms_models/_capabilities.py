"""Capabilities a family states it implements, beyond what every :class:`ModelSpec` answers.

A hook every family can answer (possibly with "nothing") is a method or attribute of
:class:`lmms_models.ModelSpec` with its default. A group of hooks only some families have is one
of the small protocols below; a family *states* it by inheriting the protocol (nominal, not
duck-typed: ``class DiffusionSpec(ModelSpec, GeneratesLatents)``), and callers branch on
``isinstance(spec, Protocol)``, never on ``hasattr`` or on a family's name. The whole contract
is written out in docs/contracts.md ("The family contract").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

__all__ = [
    "GeneratesLatents",
    "HasExperts",
    "MixedGeneration",
    "OwnTestSamples",
    "RenderRequest",
    "Renders",
    "TokenTypes",
]


@runtime_checkable
class HasExperts(Protocol):
    """Top-k routed experts (MoE decoders; :class:`lmms_models.MoESpecMixin`): the trainer picks
    the experts' implementation, meters the expert load, applies ``ep_plan`` and gives Muon the
    stacked ``[E, m, n]`` expert matrices."""

    def moe_blocks(self, model: nn.Module) -> list[nn.Module]: ...

    def router_modules(self, model: nn.Module) -> list[nn.Module]: ...

    def experts_modules(self, model: nn.Module) -> list[nn.Module]: ...

    def set_experts(self, model: nn.Module, backend: str = "grouped") -> str: ...


@runtime_checkable
class GeneratesLatents(Protocol):
    """A denoiser of latents (diffusion transformers; :class:`lmms_models.DiffusionSpec`): it
    trains on *latent batches* (``lmms_data.build_latent_loader``, docs/contracts.md) with the
    ``flow_matching`` objective, its frozen encoders attached outside the trained tree."""

    encoder_classes: ClassVar[dict[str, tuple[str, str, str]]]
    #: encoders that ``frozen_encoders: shard | offload`` may place (:meth:`encoder_blocks`)
    placeable_encoders: ClassVar[tuple[str, ...]]

    def split_encoders(self, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def build_encoder(
        self, name: str, source: dict[str, Any] | str, seed: int = 0
    ) -> nn.Module: ...

    def encoder_blocks(self, name: str, encoder: nn.Module) -> list[nn.Module]: ...

    def pretrained_config(self, path: str) -> dict[str, Any]: ...

    def tokens_fn(self, config: dict[str, Any]) -> Callable[[tuple[int, ...]], int]: ...

    def diffusion_inputs(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, Any]: ...

    def encode_batch(
        self, encoders: dict[str, nn.Module], batch: dict[str, Any], device: Any
    ) -> tuple[torch.Tensor, Any]: ...

    def drop_condition(self, model: nn.Module, cond: Any, drop: torch.Tensor) -> Any: ...

    def null_condition(self, model: nn.Module, batch_size: int, device: Any) -> Any: ...

    def denoise(
        self, model: nn.Module, x_t: torch.Tensor, timestep: torch.Tensor, cond: Any
    ) -> torch.Tensor: ...


@runtime_checkable
class MixedGeneration(Protocol):
    """Understanding and generation in one packed row (BAGEL): the data side yields rows of
    parts that the family packs itself (:meth:`finish_pack`), and the ``ce_flow_matching``
    objective puts cross-entropy on the text and flow matching on the latent tokens of one
    forward (:meth:`mixed_forward`)."""

    def processor_options(self, config: Any) -> dict[str, Any]: ...

    def finish_pack(
        self, config: Any, row: dict[str, Any], backend: str = "auto", pad_to: int | None = None
    ) -> dict[str, Any]: ...

    def prepare_row(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]: ...

    def latent_tokens(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def latent_image(
        self, model: nn.Module, tokens: torch.Tensor, like: torch.Tensor
    ) -> torch.Tensor: ...

    def mixed_forward(
        self, model: nn.Module, batch: dict[str, Any], tokens: torch.Tensor | None,
        time: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...  # fmt: skip


@dataclass(kw_only=True)
class RenderRequest:
    """What ``lmms-train render`` asks of a trained export (every family reads what it uses).

    * ``folder``: the export the model was loaded from; ``processor``: a tokenizer/processor
      folder (None: the family's default, e.g. the export itself); ``build_processor(path,
      **options)``: the data processor of the family's ``processor_family`` (lmms-data's,
      handed in by the caller: lmms-models does not import lmms-data).
    * ``prompts`` (text-conditioned), ``classes`` / ``per_class`` (class-conditioned; None: all).
    * ``frames`` / ``height`` / ``width``: the media size in pixels (frames for video).
    * ``steps``, ``method`` (``euler`` | ``heun``), ``guidance`` (classifier-free, 1: none),
      ``seed``; ``flow_matching``: the run's ``FlowMatchingConfig`` (a latent denoiser's ODE).
    """

    folder: str
    processor: str | None = None
    build_processor: Callable[..., Any] | None = None
    prompts: tuple[str, ...] = ("",)
    classes: tuple[int, ...] | None = None
    per_class: int = 4
    frames: int = 9
    height: int = 32
    width: int = 32
    steps: int = 32
    method: str = "euler"
    guidance: float = 1.0
    seed: int = 0
    flow_matching: Any = None


@runtime_checkable
class Renders(Protocol):
    """Draws media from a trained export (``lmms-train render``). Returns uint8 RGB: an image
    ``[H, W, 3]`` (a grid or a row of samples) or a video ``[F, H, W, 3]``; the caller writes the
    file (PNG, GIF or MP4). Raises ValueError on a request the model cannot serve."""

    def render(self, model: nn.Module, request: RenderRequest) -> np.ndarray: ...


@runtime_checkable
class TokenTypes(Protocol):
    """Positions or media placement that read a per-token media kind (the Qwen-VL lineage and
    LLaVA-OneVision): :mod:`lmms_models.testing` packs ``mm_token_type_ids`` beside the media."""

    def mm_token_type_ids(self, config: Any, input_ids: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class OwnTestSamples(Protocol):
    """Media that are not Qwen patch grids (LLaVA-OneVision's tiles): the family builds the
    synthetic samples of :mod:`lmms_models.testing` and the upstream call's media arguments."""

    def make_test_sample(self, config: Any, s: Any, *, gen: torch.Generator) -> dict[str, Any]: ...

    def reference_media(self, sample: dict[str, Any]) -> dict[str, Any]: ...
