"""Worker of test_linear_parallel.py (2 gloo CPU processes, one spawn for every scenario):

* Ulysses SP 2 == SP 1 for each linear-attention family: loss and gradients (summed over the
  SP ranks, as FSDP's reduce-scatter would), on a pack whose length is odd (SP padding), with a
  sample past one chunk, a length-1 sample and, for Qwen3.5(-MoE), images and video. The MoE
  family runs without the router aux loss (under SP it is each rank's own, by design).
* FSDP2 over 2 ranks with full activation checkpointing == 1 process: each rank takes its own
  pack; the loss is normalised by the global token count, so the ranks' summed gradients must
  equal the single process's gradients on both packs.

Each rank returns its results to the tests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

import lmms_parallel as lp
from lmms_models import get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples
from lmms_parallel.testing import full_grads, run_cases

FAMILIES = ["qwen3_5", "fla_gated_deltanet", "qwen3_5_moe"]


def _model(name: str):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    return spec, spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")


def _pack(spec, model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ss = [SampleSpec(text=70 + seed), SampleSpec(text=1, prompt=0), SampleSpec(text=8 + seed)]
    if "pixel_values" in spec.media_keys:
        ss += [SampleSpec(text=4, images=[(1, 4, 4)]), SampleSpec(text=3, videos=[(2, 4, 4)])]
    samples = [make_sample(spec, model.config, s, gen=gen) for s in ss]
    total = sum(s["input_ids"].numel() for s in samples)
    return pack_samples(spec, model, samples, pad_to=total + 1 + total % 2)  # odd length


def _worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-6)) for k in ref)


def sp_scenario(name: str, group: Any) -> dict[str, Any]:
    spec, model = _model(name)
    batch = _pack(spec, model, 0)
    loss, count = spec.packed_forward(model, batch)
    (loss / count).backward()
    ref, ref_loss = full_grads(model), float(loss / count)
    model.zero_grad(set_to_none=True)
    spec.set_attention(model, backend="varlen_sdpa", wrapper=lp.UlyssesAttention(group))
    handle = spec.install_sp(model, group)  # tokens sliced, the mixers' cores: linear_sp_plan
    assert len(handle[1].modules) == len(spec.linear_mixers(model))
    try:
        loss, count = spec.packed_forward(model, batch, sp_group=group)
        (loss / count).backward()
    finally:
        handle.remove()
    grads = full_grads(model)
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return {
        "loss_sp1": ref_loss,
        "loss": float(loss / count),
        "tokens": batch["input_ids"].numel(),
        "same_params": sorted(grads) == sorted(ref),
        "worst_rel_grad": _worst(grads, ref),
    }


def fsdp_scenario(name: str, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    spec, model = _model(name)
    packs = [_pack(spec, model, seed) for seed in (0, 1)]
    n_all = sum(int(p["num_loss_tokens"]) for p in packs)
    total = 0.0
    for batch in packs:  # 1 process: both packs, one global normalisation
        loss, _ = spec.packed_forward(model, batch)
        (loss / n_all).backward()
        total += float(loss)
    ref = full_grads(model)
    model.zero_grad(set_to_none=True)
    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model)
    lp.apply_activation_checkpointing(blocks, "full")
    mesh = init_device_mesh("cpu", (2,))
    lp.apply_fsdp(model, mesh, blocks=blocks + spec.embeddings(model), param_dtype=None)
    # through the root module, so FSDP2's root unit (LM head, final norm, merger) gathers and
    # reduces (the trainer's call_through_root does the same)
    model.forward = lambda **_: spec.packed_forward(model, packs[rank])
    try:
        loss, _ = model(lmms_root_call=True)
    finally:
        del model.forward
    (loss / n_all).backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    grads = full_grads(model)
    return {
        "loss_1proc": total / n_all,
        "loss": float(summed) / n_all,
        "same_params": sorted(grads) == sorted(ref),
        "worst_rel_grad": _worst(grads, ref),
    }


def run(rank: int, world: int) -> dict[str, Any]:
    """Every scenario on this rank (lmms_parallel.testing.spawn_ranks runs it)."""
    cases = []
    for name in FAMILIES:
        cases.append((f"{name}/sp2", functools.partial(sp_scenario, name, dist.group.WORLD)))
        cases.append((f"{name}/fsdp2_ac", functools.partial(fsdp_scenario, name, rank)))
    return run_cases(cases)
