"""The per-micro-batch forward the loop calls: `(model, batch) -> (loss_sum, n_tokens)`.

Wraps the model spec's packed forward with three run-time concerns the spec does not own:

- **FSDP2 root unit.** The spec calls the *base* model (`model.model`) so that no `[T, vocab]`
  logits are built; FSDP2's root hooks, which gather the root unit's parameters (final norm,
  LM head, vision merger) and schedule their gradient reduction, only run when the root module
  itself is called. So the step is run *through* the root: `model(...)` with the instance's
  `forward` temporarily set to the packed forward.
- **Ulysses SP.** With `sp_ulysses_degree > 1` the text decoder's inputs are sliced per rank
  (`lmms_parallel.SequenceParallel`), the labels are sliced to match and the loss sums are
  summed over the SP group (`sp_reduce_loss`, identity backward).
- **Vision participation.** Under FSDP a rank whose pack has no image still runs the (sharded)
  vision tower on a dummy image, where its peers run theirs (`lmms_parallel.VisionParticipation`),
  so that its collectives stay in step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmms_train._dist import DistEnv

__all__ = ["call_through_root", "make_forward"]

Forward = Callable[[nn.Module, dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]


def call_through_root(model: nn.Module, fn: Callable[[], Any]) -> Any:
    """Run `fn()` as `model`'s forward, so module hooks (FSDP2's root unit) fire around it."""
    model.forward = lambda *_a, **_k: fn()  # instance attribute shadows the class method
    try:
        return model()
    finally:
        del model.forward


def _sp_packed_forward(
    spec: Any, model: nn.Module, batch: dict[str, Any], group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's packed forward with this rank's slice of the row (hooks installed by setup)."""
    from lmms_kernels import fused_linear_cross_entropy
    from lmms_models import shift_labels_packed, text_attention_kwargs
    from lmms_parallel import sp_reduce_loss, sp_shard_labels

    head = spec.lm_head(model)
    dev = head.weight.device
    input_ids = batch["input_ids"].to(dev).reshape(1, -1)  # [1, T]
    n_tokens = input_ids.shape[1]
    cu = batch["cu_seqlens"].to(dev, torch.int32)  # [n+1]
    max_len = int(batch["max_seqlen"])
    if "shift_labels" in batch:
        shift = batch["shift_labels"].to(dev).reshape(-1)  # [T]
    else:
        shift = shift_labels_packed(batch["labels"].to(dev).reshape(-1), cu)
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": spec.pack_position_ids(batch, n_tokens, dev),
        "attention_mask": None,
        "use_cache": False,
    }
    inputs.update(spec.media_inputs(batch, dev))
    kwargs = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
    with text_attention_kwargs(spec.sp_slice_module(model), **kwargs):
        out = spec.base_model(model)(**inputs)
    hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])  # [T_pad/sp, H]
    if hidden.is_cuda and torch.is_autocast_enabled("cuda"):
        hidden = hidden.to(torch.get_autocast_dtype("cuda"))
    local = sp_shard_labels(shift, group)  # [T_pad/sp]
    loss_sum, n = fused_linear_cross_entropy(hidden, head.weight, local, bias=head.bias)
    return sp_reduce_loss(loss_sum, n, group)


def _dummy_vision_inputs(
    spec: Any, model: nn.Module, device: torch.device
) -> Callable[[], dict[str, Any]]:
    """One 2x2-patch image for a Qwen-VL vision tower (the smallest valid input)."""
    hook = getattr(spec, "dummy_vision_inputs", None)
    if hook is not None:
        return lambda: hook(model, device)
    vc = getattr(model.config, "vision_config", None)
    patch = getattr(vc, "patch_size", 14)
    tp = getattr(vc, "temporal_patch_size", 2)
    chans = getattr(vc, "in_channels", getattr(vc, "in_chans", 3))
    merge = getattr(vc, "spatial_merge_size", 2)

    def make() -> dict[str, Any]:
        grid = torch.tensor([[1, merge, merge]], device=device)
        pixels = torch.zeros(merge * merge, chans * tp * patch * patch, device=device)
        return {"hidden_states": pixels, "grid_thw": grid}

    return make


def make_forward(spec: Any, model: nn.Module, env: DistEnv) -> Forward:
    """The forward for this run's layout (plain, FSDP, SP)."""
    group = None
    tower = spec.vision_tower(model) if env.distributed else None
    if tower is not None:  # before SequenceParallel on the same module (lmms_parallel's order)
        from lmms_parallel import VisionParticipation

        dummy = _dummy_vision_inputs(spec, model, env.device)
        VisionParticipation(spec.sp_slice_module(model), tower, dummy).install()
    if env.sp > 1:
        from lmms_parallel import SequenceParallel, sp_group

        group = sp_group(env.mesh)
        SequenceParallel(spec.sp_slice_module(model), group).install()
    native_sp = "sp_group" in inspect.signature(spec.packed_forward).parameters

    # No explicit ensure_vision_participation here: the hook above runs the dummy where the
    # peers run the tower; a call before the forward would put its all-gathers first.
    def packed(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if group is None:
            return spec.packed_forward(model, batch)
        if native_sp:
            return spec.packed_forward(model, batch, sp_group=group)
        return _sp_packed_forward(spec, model, batch, group)

    def forward(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return call_through_root(model, lambda: packed(model, batch))

    return forward
