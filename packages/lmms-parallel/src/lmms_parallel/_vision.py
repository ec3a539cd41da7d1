"""Keep the collectives of a sharded vision tower in step when a rank has no media.

Under FSDP2 every vision block all-gathers its weights in forward and reduce-scatters its
gradients in backward. A rank whose batch has no image would skip both while its peers wait
forever. :func:`ensure_vision_participation` runs the tower on a tiny dummy input on such a rank
and returns ``0 * (sum of every floating-point output)``: adding it to the loss makes backward's
reduce-scatters run too, with zero gradient, so the update is unchanged. Cost: one
forward+backward of a few patches.

Two things must match the peers, not just "the tower ran":

- **Which parameters get a gradient.** FSDP2 reduce-scatters one flat buffer per unit made of the
  parameters that *have* a gradient, so every tower parameter a real image reaches must be
  reached by the dummy too. A Qwen-VL tower returns the pre-merger states first, the merged
  tokens (``pooler_output``) and, for Qwen3-VL, the deepstack features next; the merger and
  deepstack mergers sit in the root unit. Keeping only the first output left them without a
  gradient, and the root unit's reduce-scatter was smaller on the text-only rank (the gloo
  "collective mismatch" of the 2-rank test). Hence the sum over all outputs.
- **Order.** The peers run the tower inside the model forward after the embedding lookup:
  prefer :class:`VisionParticipation`, which runs the dummy at exactly that point, so the
  all-gathers, the backward pre-unshards (prefetch follows the forward order) and the
  post-backward reduce-scatters come in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["VisionParticipation", "ensure_vision_participation"]


def _float_tensors(out: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a tower output (tensor, ModelOutput, dict, nested lists)."""
    if torch.is_tensor(out):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):  # also transformers' ModelOutput (set fields only)
        values = list(out.values())
    elif hasattr(out, "to_tuple"):
        values = list(out.to_tuple())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        values = []
    return [t for value in values for t in _float_tensors(value)]


def ensure_vision_participation(
    vision_tower: nn.Module | None,
    dummy_inputs: Callable[[], dict[str, Any]],
    *,
    has_media: bool,
    outputs: Callable[[Any], list[torch.Tensor]] | None = None,
) -> torch.Tensor | None:
    """Return ``0 * tower(**dummy_inputs())`` summed when ``has_media`` is False, else ``None``.

    Args:
        vision_tower: the (FSDP-sharded) vision tower, e.g. ``spec.vision_tower(model)``;
            ``None`` for text-only models (returns ``None``).
        dummy_inputs: builds keyword arguments of a minimal valid tower input (from the model
            spec: e.g. one 2x2-patch image for Qwen-VL).
        has_media: whether this rank's batch has images or videos.
        outputs: maps the tower's output to the tensors to sum (default: every floating-point
            output). For a model whose media path continues outside the tower (LLaVA's projector
            and newline) or reads a hidden layer instead of the final output: the same
            parameters must get a gradient as on the ranks with media.

    The returned fp32 scalar must be added to the loss before backward. It sums *all*
    floating-point outputs (merged tokens, deepstack features...), so every trainable tower
    parameter gets a (zero) gradient, as on the ranks with images. Everything runs under the
    caller's autocast / grad mode; with a frozen tower the forward alone keeps ranks in step.
    Call it where the peers run the tower (see :class:`VisionParticipation`), not before the
    model forward.
    """
    if has_media or vision_tower is None:
        return None
    out = vision_tower(**dummy_inputs())
    tensors = outputs(out) if outputs is not None else None
    if tensors is None:  # the caller's selection may decline: every output then
        tensors = _float_tensors(out)
    if not tensors:
        raise TypeError(f"the vision tower returned no floating-point tensor: {type(out).__name__}")
    return torch.stack([t.float().sum() for t in tensors]).sum() * 0.0


class VisionParticipation:
    """Automatic form of :func:`ensure_vision_participation`, with the collective order right.

    Hooks the vision tower (records that it ran) and the text decoder (``spec.sp_slice_module``):
    when the decoder starts and the tower has not run in this forward (no media on this rank),
    the tower runs on ``dummy_inputs()`` and ``0 * (sum of all its outputs)`` is added to the
    decoder's ``inputs_embeds``. That is exactly where the peers with media run the tower (after
    the embedding lookup, before the decoder layers), so FSDP's all-gathers and, in backward, its
    reduce-scatters happen in the same order, over the same parameters, on every rank; values
    and gradients are unchanged. Nothing to add to the loss, and no explicit
    :func:`ensure_vision_participation` call besides (it would count as "the tower ran").
    Install before :class:`SequenceParallel` on the same module.
    """

    def __init__(
        self,
        decoder: nn.Module,
        vision_tower: nn.Module,
        dummy_inputs: Callable[[], dict[str, Any]],
        *,
        outputs: Callable[[Any], list[torch.Tensor]] | None = None,
    ) -> None:
        self.decoder, self.tower, self.dummy_inputs = decoder, vision_tower, dummy_inputs
        self.outputs = outputs  # see ensure_vision_participation
        self._ran = False
        self._handles: list[Any] = []

    def install(self) -> VisionParticipation:
        if self._handles:
            raise RuntimeError("VisionParticipation is already installed")
        self._handles = [
            self.tower.register_forward_hook(self._tower_ran),
            self.decoder.register_forward_pre_hook(self._before_decoder, with_kwargs=True),
        ]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _tower_ran(self, module: nn.Module, args: Any, output: Any) -> None:
        self._ran = True

    def _before_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ran, self._ran = self._ran, False
        if ran:
            return args, kwargs
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise ValueError(
                "VisionParticipation needs the decoder to be called with inputs_embeds "
                "(the multimodal model's merge output)"
            )
        zero = ensure_vision_participation(
            self.tower, self.dummy_inputs, has_media=False, outputs=self.outputs
        )
        self._ran = False  # the dummy call itself set it
        kwargs["inputs_embeds"] = embeds + zero.to(embeds.dtype)
        return args, kwargs
