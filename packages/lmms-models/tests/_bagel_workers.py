"""Spawned workers for test_bagel.py: FSDP2 (one unit per MoT decoder layer and per ViT layer,
then the root) on 2 ranks == 1 process, losses and gradients, on CPU with gloo. Rank 0 gets the
understanding + generation samples, rank 1 editing + text: each rank's experts see other work."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = _case(rank)
    except Exception:
        res = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
