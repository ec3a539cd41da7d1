"""Spawned workers for test_bagel.py: FSDP2 (one unit per MoT decoder layer and per ViT layer,
then the root) on 2 ranks == 1 process, losses and gradients, on CPU with gloo. Rank 0 gets the
understanding + generation samples, rank 1 editing + text: each rank's experts see other work."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmms_parallel.testing import run_cases

sys.path.insert(0, str(Path(__file__).parent))

_SHARDS = [["und", "gen"], ["edit", "text", "one"]]


def _case(rank: int) -> dict[str, Any]:
    import _bagel_cases as cases
    from torch.distributed.device_mesh import init_device_mesh

    from lmms_parallel import apply_fsdp

    spec, model = cases.tiny_model()
    total = 50.0  # one global normaliser for both layouts
    ref_loss, _, ref = cases.loss_grads(spec, model, cases.pack(_SHARDS[0] + _SHARDS[1]), total)
    mesh = init_device_mesh("cpu", (2,))
    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model)
    apply_fsdp(model, mesh, blocks=blocks, param_dtype=None)
    loss, _, grads = cases.loss_grads(spec, model, cases.pack(_SHARDS[rank]), total)
    summed = torch.tensor(loss)
    dist.all_reduce(summed)
    return {"loss": float(summed), "loss_1proc": ref_loss, "worst": cases.worst(ref, grads)}


def _sp_case() -> dict[str, Any]:
    """Ulysses SP 2 == SP 1 on the mixed pack (span masks across the split, both experts)."""
    import _bagel_cases as cases

    from lmms_models.objectives import ObjectiveContext, get_objective

    spec, model = cases.tiny_model()
    batch = cases.pack(cases.PACKS["mixed"])
    ref_loss, _, ref = cases.loss_grads(spec, model, batch, 10.0)
    obj = get_objective("ce_flow_matching", ce_weight=1.0, fm_weight=2.0)
    model.zero_grad(set_to_none=True)
    spec.install_sp(model, dist.group.WORLD)  # what lmms-train's forward installs under SP
    out = obj.loss(spec, model, batch, ObjectiveContext(seed=3, sp_group=dist.group.WORLD))
    (out.loss_sum / 10.0).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for g in grads.values():  # FSDP sums gradients over the dp_shard x sp mesh
        dist.all_reduce(g)
    return {"loss": float(out.loss_sum), "loss_1proc": ref_loss, "worst": cases.worst(ref, grads)}


def _sp_lm_case() -> dict[str, Any]:
    """``causal_lm`` through ``BagelSpec.packed_forward`` (the row's text CE, every rank holding
    the whole row's sum: lmms_parallel.sp_replicated_grad) under SP 2 == 1 process; the plan's
    handle restores the model (the loss after ``remove()`` is the reference's, bit for bit)."""
    import _bagel_cases as cases

    from lmms_models.objectives import ObjectiveContext, get_objective

    spec, model = cases.tiny_model()
    batch = cases.pack(cases.PACKS["mixed"])
    obj = get_objective("causal_lm")

    def loss_grads(group: Any = None) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = obj.loss(spec, model, batch, ObjectiveContext(seed=3, sp_group=group))
        (out.loss_sum / 10.0).backward()
        return float(out.loss_sum), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                     if p.grad is not None}  # fmt: skip

    ref_loss, ref = loss_grads()
    handle = spec.install_sp(model, dist.group.WORLD)
    loss, grads = loss_grads(dist.group.WORLD)
    for g in grads.values():  # FSDP sums gradients over the dp_shard x sp mesh
        dist.all_reduce(g)
    handle.remove()
    after, _ = loss_grads()
    return {"loss": loss, "loss_1proc": ref_loss, "worst": cases.worst(ref, grads),
            "restored": after == ref_loss, "same_params": grads.keys() == ref.keys()}  # fmt: skip


def run(rank: int, world: int) -> dict[str, Any]:
    """The cases on this rank (lmms_parallel.testing.spawn_ranks runs it)."""
    return run_cases([("sp", _sp_case), ("sp_lm", _sp_lm_case), ("fsdp", lambda: _case(rank))])
