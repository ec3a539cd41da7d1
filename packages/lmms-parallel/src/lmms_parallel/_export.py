"""Export a (sharded) model as a consolidated Hugging Face safetensors folder.

All ranks take part in gathering the full state dict (one parameter at a time, offloaded to
rank 0's CPU); rank 0 writes it. A ``transformers`` model is written with its own
``save_pretrained(state_dict=...)`` so that key renaming, tied weights, shard index and
``config.json`` are exactly what ``from_pretrained`` expects; any other module is written as
plain safetensors shards with an index.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

__all__ = ["export_hf", "gather_full_state_dict"]


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict on rank 0, ``{}`` on the other ranks. Collective.

    Tensor-parallel and FSDP2 DTensors are gathered by DCP's state-dict helpers; expert-parallel
    slices (``lmms_parallel.ExpertParallel``) are all-gathered over their EP group into the whole
    ``[E, ...]`` tensors, so the result loads into the single-device upstream model."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from ._ep import ep_params

    experts: dict[str, torch.Tensor] = {}
    for fqn, module, name, st in ep_params(model):  # same order on every rank
        p = getattr(module, name).detach()
        local = p.full_tensor() if hasattr(p, "full_tensor") else p  # this rank's experts
        parts = [torch.empty_like(local) for _ in range(st.size)]
        dist.all_gather(parts, local.contiguous(), group=st.group)
        if dist.get_rank() == 0:
            experts[fqn] = torch.cat(parts).cpu()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        full.update(experts)
    return full


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
    weights: nn.Module | None = None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    writer: Callable[..., Any] | None = None,
) -> Path | None:
    """Write ``out_dir`` loadable by ``from_pretrained``; returns it on rank 0, ``None`` elsewhere.

    Args:
        dtype: cast floating-point weights (e.g. ``torch.bfloat16`` for release); default keeps
            the master dtype.
        weights: the module whose state dict is written, when it is not ``model`` itself (e.g.
            ``MasterWeights.state_module()``: the fp32 masters of a bf16 model); ``model`` still
            provides ``save_pretrained`` and the config.
        transform: on rank 0, maps the gathered full state dict to the one written (e.g. LoRA
            adapters merged into the upstream weights: ``lmms_models.LoraHandle.merged_state``).
        writer: ``writer(out_dir, state_dict=full)`` writes the folder in the model's own layout
            (the model family's export hook, ``ModelSpec.export_writer``); default: transformers'
            ``save_pretrained`` of the model's class, or plain safetensors shards.
    """
    full = gather_full_state_dict(model if weights is None else weights)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if transform is not None:
        full = transform(full)
    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    if writer is not None:
        writer(str(out), state_dict=full)
    elif (save_pretrained := getattr(_unwrapped(model), "save_pretrained", None)) is not None:
        save_pretrained(
            str(out), state_dict=full, safe_serialization=True, max_shard_size=max_shard_size
        )
    else:
        _write_plain(full, out)
    if dist.is_initialized():
        dist.barrier()
    return out


def _unwrapped(model: nn.Module) -> nn.Module:
    """``model``, or for an FSDP2-wrapped transformers model a weightless (meta) instance of its
    own class: transformers finds the key renaming it reverts on save (e.g. Qwen2.5-VL's
    ``model.language_model.*`` back to the hub's ``model.*``) by class name, which FSDP2's
    wrapper class (``FSDP<Name>``) hides, so the wrapped model would write its internal names.
    (A family that writes its own layout hands ``export_hf`` its ``writer``.)"""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule) or not hasattr(model, "config"):
        return model
    cls = next(c for c in type(model).__mro__[1:] if not issubclass(c, FSDPModule))
    with torch.device("meta"):  # eager attention: the run's may be registered under any name
        twin = cls._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    twin.config = model.config  # what config.json says is the run's config
    return twin


def _write_plain(state: dict[str, torch.Tensor], out: Path, shard_bytes: int = 5 << 30) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: dict[int, str] = {}
    for key, value in state.items():
        if value.data_ptr() in seen and value.numel():  # tied: safetensors refuses shared storage
            value = value.clone()
        seen[value.data_ptr()] = key
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
