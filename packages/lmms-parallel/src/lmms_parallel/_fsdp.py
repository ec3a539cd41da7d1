"""FSDP2 (``fully_shard``) applied from outside, one unit per block.

Order matters: every block (decoder blocks, vision blocks, embeddings) becomes its own FSDP unit
so that only one block's full weights are alive at a time; the root unit takes what remains
(final norm, lm_head, vision merger...). Gradients are **summed** over the data-parallel and
sequence-parallel ranks (divide factor 1): the trainer normalises the loss by the token count of
the whole global batch, so the result equals the single-process run whatever the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

__all__ = ["apply_fsdp", "replace_sharded_param"]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Sequence[nn.Module],
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    cast_forward_inputs: bool = False,
    units: Sequence[tuple[nn.Module, DeviceMesh]] = (),
) -> nn.Module:
    """Shard ``model`` with FSDP2: each of ``blocks`` is a unit, then the root.

    Args:
        model: the (meta or materialised) model; modified in place and returned.
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP); see ``fsdp_mesh``.
        blocks: modules to shard separately, e.g. ``spec.vision_blocks(model) +
            spec.decoder_blocks(model) + spec.embeddings(model)``. A module whose parameter is
            shared with a module outside it (tied embeddings / lm_head) is left to the root unit,
            because one parameter cannot belong to two FSDP units.
        param_dtype: compute dtype of the all-gathered weights (bf16 by default); master weights
            and optimizer state stay in the dtype the model was built with (fp32). ``None``
            computes in the storage dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (fp32 by default).
        reshard_after_forward: free gathered weights after forward (ZeRO-3, least memory) or
            keep them until backward (ZeRO-2 like, one all-gather fewer per block).
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU (slow, for
            models that do not fit otherwise).
        cast_forward_inputs: cast every unit's floating-point inputs to ``param_dtype`` (FSDP2's
            default). Off here: units get their inputs as the model computes them (a vision
            tower's fp32 rotary tables stay fp32; the model casts where it means to), which is
            also what ``MasterWeights`` does on one device: both give the same numbers.

    ``units``: modules sharded first, each on its own mesh (the experts under expert
    parallelism: :func:`lmms_parallel.expert_meshes`' ``fsdp`` mesh, the ranks that hold the same
    experts); the blocks containing them then leave their parameters to them.

    Frozen sub-modules (``requires_grad=False``, e.g. the vision tower) are supported: they are
    sharded and all-gathered like the others but get no gradient reduction.
    """
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_forward_inputs
    )
    kwargs: dict = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        # Pinned host memory makes the host<->device copies asynchronous; it needs CUDA.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    shared = _shared_param_ids(model)
    for unit, unit_mesh in units:
        fully_shard(
            unit, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": unit_mesh}
        )
    for block in blocks:
        own = {id(p) for p in block.parameters()}
        if own & shared and _shared_outside(model, block):
            continue
        if not own:
            continue
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters (lm_head, final norm) are needed right after forward by the loss:
    # resharding them would only add an all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    _sum_gradients(model)
    return model


@torch.no_grad()
def replace_sharded_param(
    model: nn.Module, name: str, fn: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replace the frozen FSDP2-sharded parameter ``name`` by ``fn(its full tensor)``, sharded the
    same way (dim 0 over the shard ranks), e.g. QLoRA's base weights as torchao's ``NF4Tensor``,
    a tensor subclass that implements FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``): its 4-bit shards stay 4-bit and are all-gathered as such.

    Collective (every rank, same order); one full tensor at a time. ``fn``'s result must split
    into equal shards along dim 0 (a subclass cannot be padded as FSDP2 pads plain tensors).
    Needs at least 2 shard ranks: FSDP2's one-rank path copies a single all-gather input and
    refuses a subclass with several (NF4 has three), so one rank is refused here.
    FSDP2 learns of the new shard as after ``load_state_dict(assign=True)``
    (``FSDPParam.reset_sharded_param``); its record of the old shard is replaced first, since
    torch compares the old and new storages, which a wrapper subclass does not have.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    old = model.get_parameter(name)
    if not isinstance(old, DTensor) or old.requires_grad:
        raise ValueError(f"{name}: a frozen FSDP2-sharded parameter is expected")
    mesh, dim = old.device_mesh, len(old.placements) - 1  # the shard dim: HSDP's last
    shards = mesh.size(dim)
    if shards < 2:
        raise ValueError(f"{name}: FSDP2 over one rank cannot all-gather a tensor subclass")
    full = fn(old.full_tensor())
    if full.size(0) % shards:
        raise ValueError(f"{name}: {full.size(0)} rows do not split over {shards} ranks")
    local = torch.chunk(full, shards, dim=0)[mesh.get_local_rank(dim)]
    meta = TensorMeta(old.size(), old.stride(), old.dtype)
    new = DTensor(local, DTensorSpec(mesh, old.placements, tensor_meta=meta), requires_grad=False)
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    record = _fsdp_param(model, owner, leaf)
    setattr(owner, leaf, nn.Parameter(new, requires_grad=False))
    record._sharded_param_data = local.view(-1)
    record.reset_sharded_param()
    record._init_extensions()  # the new shard's all-gather hooks (a plain shard had none)
    record.all_gather_outputs = []  # sized for the new shard's all-gather inputs on first use


def _fsdp_param(model: nn.Module, owner: nn.Module, leaf: str) -> Any:  # torch private: FSDPParam
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        for record in group.fsdp_params if group is not None else ():
            if record._module_info.module is owner and record._module_info.param_name == leaf:
                return record
    raise ValueError(f"{type(owner).__name__}.{leaf} is not managed by FSDP2 (fully_shard)")


def _shared_param_ids(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _shared_outside(model: nn.Module, block: nn.Module) -> bool:
    own = {id(p) for p in block.parameters()}
    inside = {id(m) for m in block.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        if any(id(p) in own for p in module.parameters(recurse=False)):
            return True
    return False


def _sum_gradients(model: nn.Module) -> None:
    """Make FSDP2 sum (not average) gradients over its ranks, on every unit.

    A divide factor of 1 alone makes FSDP use NCCL's PreMulSum, which gloo lacks; forcing
    sum-only reductions (where this torch has it) gives a plain SUM on every backend.
    """
    for module in model.modules():
        if not hasattr(module, "unshard"):
            continue
        setter = getattr(module, "set_gradient_divide_factor", None)
        if setter is None:  # torch < 2.8
            setter = module.set_reduce_scatter_divide_factor
        setter(1.0)
        force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
        if force_sum is not None:
            force_sum(True)
