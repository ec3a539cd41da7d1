"""Worker of test_sp_vl.py: Ulysses SP 2 and 4 (gloo, 4 CPU processes) against the 1-process
packed forward, for every VL family and each way its media reach the decoder. One spawn runs
every scenario; results go to per-rank JSON files the tests read."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from test_packed_parity import MEDIA_FAMILIES, tiny_pack

import lmms_parallel as lp
from lmms_parallel.testing import run_cases

#: (family, scenario name, spec attributes set for the run). "split": each SP rank encodes its
#: FLOPs-balanced share of the pack's images/frames (lmms_parallel.SplitVision); "split_few": a pack
#: with fewer vision items than ranks (the others run the dummy input and gather zero rows).
SCENARIOS: list[tuple[str, str, dict[str, Any]]] = [
    *[(name, "host_merge", {}) for name in MEDIA_FAMILIES],
    ("qwen3_vl", "upstream_merge", {"host_merge": False}),  # deepstack as upstream's bool mask
    *[(name, "split", {}) for name in MEDIA_FAMILIES],
    ("qwen2_5_vl", "split_few", {}),
    ("qwen2_5_vl", "lora", {}),  # peft's LoRA layers on the decoder (lmms_models.apply_lora)
]
LORA = {"rank": 4, "alpha": 8.0}


def _lora(spec, model) -> Any:
    """Adapters on the decoder, ``B`` given values (it starts at zero: no gradient reaches A)."""
    from lmms_models import LoraOptions, apply_lora

    handle = apply_lora(spec, model, LoraOptions(**LORA), seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    return handle


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _step(spec, model, batch, group) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, count = spec.packed_forward(model, batch, sp_group=group)
    (loss / count).backward()
    grads = _grads(model)
    if group is not None:  # each rank holds its slice's contribution: the sum is the whole row's
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return float(loss / count), grads


def _split_vision(spec, model, group) -> lp.SplitVision:
    """The trainer's vision split: the family's plan, lmms-parallel's hooks."""
    return lp.SplitVision(
        spec.vision_tower(model), functools.partial(spec.vision_split_plan, model), group
    )


def scenario(
    name: str, label: str, attrs: dict[str, Any], groups: dict[int, Any]
) -> dict[str, Any]:
    spec, model, batch = tiny_pack(name, 4 if label == "split_few" else None)
    if label == "lora":
        _lora(spec, model)
    saved = {k: getattr(spec, k) for k in attrs}
    for k, v in attrs.items():
        setattr(spec, k, v)
    try:
        ref_loss, ref = _step(spec, model, batch, None)
        out: dict[str, Any] = {"loss_sp1": ref_loss}
        for sp, group in groups.items():
            spec.set_attention(model, backend="varlen_sdpa", wrapper=lp.UlyssesAttention(group))
            split = _split_vision(spec, model, group if label.startswith("split") else None)
            with split, lp.SequenceParallel(spec.sp_slice_module(model), group):
                loss, grads = _step(spec, model, batch, group)
            spec.set_attention(model, backend="varlen_sdpa")
            worst = max(
                float((grads[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-6)) for k in ref
            )
            out[f"sp{sp}"] = {
                "shares": split.last_costs,
                "loss": loss,
                "same_params": sorted(grads) == sorted(ref),
                "worst_rel_grad": worst,
            }
        return out
    finally:
        for k, v in saved.items():
            setattr(spec, k, v)


def lora_fsdp(pair: Any) -> dict[str, Any]:
    """FSDP2 over a rank pair with adapters, built as the trainer does: on meta, adapters
    injected, sharded (frozen base and trainable adapters in the same units), materialised, then
    the base weights renamed for the adapters plus the initial adapters broadcast from the pair's
    first rank. The loss and the adapters' gradients equal the one-process adapted model's."""
    from torch.distributed.device_mesh import DeviceMesh

    spec, model, batch = tiny_pack("qwen2_5_vl")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    _lora(spec, model)
    ref_loss, ref = _step(spec, model, batch, None)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    with lp.meta_init():
        sharded = spec.build(config=spec.tiny_config(), device="meta", attn_backend="varlen_sdpa")
    handle = _lora(spec, sharded)
    mesh = DeviceMesh.from_group(pair, "cpu")
    blocks = spec.vision_blocks(sharded) + spec.decoder_blocks(sharded) + spec.embeddings(sharded)
    lp.apply_fsdp(sharded, mesh, blocks=blocks, param_dtype=None)
    lp.materialize(sharded, "cpu")
    state = handle.adapted_state(base, seed=3)
    state.update({k: v for k, v in full.items() if ".lora_B." in k})  # the values given to B
    lp.load_full_state_dict(sharded, state if dist.get_rank(pair) == 0 else None)
    sharded.zero_grad(set_to_none=True)
    sharded.forward = lambda **_: spec.packed_forward(sharded, batch)  # through FSDP2's root
    try:
        loss, count = sharded(lmms_root_call=True)
    finally:
        del sharded.forward
    # both ranks ran the same row: the global normaliser counts it twice (FSDP2 sums gradients)
    (loss / (2 * count)).backward()
    grads = {k: p.grad.full_tensor() for k, p in sharded.named_parameters() if p.grad is not None}
    worst = max(float((grads[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-6)) for k in ref)
    return {
        "loss_sp1": ref_loss,
        "loss": float(loss / count),
        "same_params": sorted(grads) == sorted(ref) and all(".lora_" in k for k in ref),
        "worst_rel_grad": worst,
    }


def dpo_sp(groups: dict[int, Any]) -> dict[str, Any]:
    """``dpo`` on packed preference pairs (Qwen2.5-VL, images, LoRA; the reference = adapters
    off) under Ulysses SP 2 and 4 == SP 1: the per-document log-probabilities are summed over
    the group, each rank backpropagates its slice's share."""
    from test_dpo import _pairs

    from lmms_models import get_model_spec
    from lmms_models.objectives import ObjectiveContext, get_objective
    from lmms_models.testing import pack_samples

    spec = get_model_spec("qwen2_5_vl")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    handle = _lora(spec, model)
    docs = _pairs(spec, model, 3, torch.Generator().manual_seed(3))
    batch = pack_samples(spec, model, docs)
    batch["sample_segments"] = torch.full((3,), 2)
    objective = get_objective("dpo", beta=0.5)

    def step(group: Any) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        ctx = ObjectiveContext(reference=handle.disabled, sp_group=group)
        out = objective.loss(spec, model, batch, ctx)
        out.loss_sum.backward()
        grads = _grads(model)
        if group is not None:
            for g in grads.values():
                dist.all_reduce(g, group=group)
        return float(out.loss_sum), grads

    ref_loss, ref = step(None)
    out: dict[str, Any] = {"loss_sp1": ref_loss}
    for sp, group in groups.items():
        spec.set_attention(model, backend="varlen_sdpa", wrapper=lp.UlyssesAttention(group))
        with (
            _split_vision(spec, model, None),
            lp.SequenceParallel(spec.sp_slice_module(model), group),
        ):
            loss, grads = step(group)
        spec.set_attention(model, backend="varlen_sdpa")
        worst = max(
            float((grads[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-6)) for k in ref
        )
        out[f"sp{sp}"] = {"loss": loss, "same_params": sorted(grads) == sorted(ref),
                          "worst_rel_grad": worst}  # fmt: skip
    return out


def run(rank: int, world: int) -> dict[str, Any]:
    """Every scenario on this rank (lmms_parallel.testing.spawn_ranks runs it)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    cases = [(f"{name}/{label}", functools.partial(scenario, name, label, attrs, groups))
             for name, label, attrs in SCENARIOS]  # fmt: skip
    extra = [("lora_fsdp", lambda: lora_fsdp(pairs[rank // 2])), ("dpo_sp", lambda: dpo_sp(groups))]
    return run_cases([*cases, *extra])
