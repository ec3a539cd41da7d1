"""Workers of test_ep_tp.py: expert and tensor parallelism (gloo, CPU) against one process.

Every scenario builds the tiny upstream model on the meta device, applies the spec's plans from
outside in the trainer's order (TP/EP, then FSDP2 with the experts as their own units), loads
rank 0's weights, and trains three optimizer steps; rank 0 runs the same packs through the plain
model in the same process. Results (losses, step-1 gradient errors, final parameter errors) go
to per-rank JSON files the tests read. One spawn per world size runs every scenario.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lmms_parallel as lp
from lmms_models import get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples

STEPS = 3
CKPT_STEP = 2  # scenarios with a checkpoint save after this step and resume from it
CLIP = 1.0  # global-norm clipping (the tiny models' gradients exceed it at first)


def _pack(spec, model, seed: int, image: bool, n: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ss = [SampleSpec(text=5 + (seed + i) % 7, prompt=1) for i in range(n)]
    if image:
        ss[0] = SampleSpec(text=4, images=[(1, 4, 4)])
    samples = [make_sample(spec, model.config, s, gen=gen) for s in ss]
    total = sum(s["input_ids"].numel() for s in samples)
    return pack_samples(spec, model, samples, pad_to=total + 2)


def _config(name: str, aux: bool) -> dict[str, Any]:
    """The tiny config; MoE with the router aux loss on (off under SP, where each rank takes
    aux over its slice by design, so SP 2 differs from SP 1 there)."""
    spec = get_model_spec(name)
    if name == "qwen3_vl_moe":
        return spec.tiny_config(text_config={"output_router_logits": aux})
    if name == "qwen3_moe":
        return spec.tiny_config(output_router_logits=aux, router_aux_loss_coef=0.05)
    return spec.tiny_config()


def _optimizer(spec, model: nn.Module, kind: str):
    """AdamW, or Muon with the experts' [E, m, n] stacks as a `stacked` group (each expert
    matrix orthogonalised on its own, on the EP rank that holds it; as the trainer does)."""
    if kind == "adamw":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    from lmms_optim import Muon, build_muon_param_groups

    experts = spec.experts_modules(model) if hasattr(spec, "experts_modules") else []
    stack_ids = {id(p) for m in experts for p in m.parameters()}
    groups = build_muon_param_groups(model, lr=2e-2, adamw_lr=3e-3)
    for g in groups:
        g["params"] = [p for p in g["params"] if id(p) not in stack_ids]
    stacks = [p for n, p in model.named_parameters() if id(p) in stack_ids]
    if stacks:
        groups.append({"params": stacks, "use_muon": True, "stacked": True, "lr": 2e-2})
    return Muon([g for g in groups if g["params"]], lr=2e-2)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _named_full(model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) as the whole tensor: DTensors gathered, EP slices gathered
    over their EP group."""
    ep = {fqn: st for fqn, _m, _p, st in lp.ep_params(model)}
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        t = _full(t).detach().clone()
        if name in ep:
            st = ep[name]
            parts = [torch.empty_like(t) for _ in range(st.size)]
            dist.all_gather(parts, t.contiguous(), group=st.group)
            t = torch.cat(parts)
        out[name] = t
    return out


def _rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list:
    """[worst relative error over the parameters, its name]."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    errs = {k: float((got[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-8)) for k in ref}
    worst = max(errs, key=errs.__getitem__)
    return [errs[worst], worst]


def _reference(name, cfg, packs, opt_kind):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(config=cfg, attn_backend="varlen_sdpa")
    if hasattr(spec, "set_experts"):
        spec.set_experts(model, "grouped")
    opt = _optimizer(spec, model, opt_kind)
    losses, grads1, norms = [], None, []
    for step_packs in packs:
        outs = [spec.packed_forward(model, b) for b in step_packs]
        total = sum(int(n) for _, n in outs)
        loss = sum(s for s, _ in outs) / total
        loss.backward()
        if grads1 is None:
            grads1 = _named_full(model, grads=True)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, grads1, _named_full(model, grads=False), norms


def _parallel_model(spec, cfg, mesh, *, tp: int, ep: int, weights, seed: int = 0) -> nn.Module:
    """The trainer's order: meta build, TP/EP plans, FSDP2 (experts as their own units),
    materialise, rank 0's weights."""
    torch.manual_seed(seed)
    with lp.meta_init():
        model = spec.build(config=cfg, device="meta", attn_backend="varlen_sdpa")
    if hasattr(spec, "set_experts"):
        spec.set_experts(model, "grouped")
    units = []
    if tp > 1:
        spec.check_tp(model.config, tp)
        lp.apply_tp(spec.plan_root(model), spec.tp_plan, lp.tp_mesh(mesh))
    if ep > 1:
        em = lp.expert_meshes(mesh, ep)
        lp.apply_ep(spec.plan_root(model), spec.ep_plan, em.ep_group)
        units = [(m, em.fsdp) for m in spec.experts_modules(model)]
    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model) + spec.embeddings(model)
    lp.apply_fsdp(model, lp.fsdp_mesh(mesh), blocks=blocks, param_dtype=None, units=units)
    lp.materialize(model, "cpu")
    lp.load_full_state_dict(model, weights)
    return model


def _resume_one_process(name, cfg, packs, opt_kind, ckpt, group, final) -> dict[str, Any]:
    """Rank 0 alone: the plain model (no EP, no TP, no FSDP) loads the parallel run's checkpoint
    and takes the remaining steps on every DP rank's packs."""
    spec = get_model_spec(name)
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = spec.build(config=cfg, attn_backend="varlen_sdpa")
    if hasattr(spec, "set_experts"):
        spec.set_experts(model, "grouped")
    opt = _optimizer(spec, model, opt_kind)
    ckpt.load(model=model, optimizer=opt, process_group=group)
    losses = []
    for step_packs in packs[CKPT_STEP:]:
        outs = [spec.packed_forward(model, b) for b in step_packs]
        loss = sum(s for s, _ in outs) / sum(int(n) for _, n in outs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"one_losses": losses, "one_param_err": _rel_err(_named_full(model, False), final)[0]}


def run_case(
    name: str, *, tp=1, ep=1, sp=1, dp_shard=-1, opt_kind="adamw", images=True, ckpt_dir=None
):
    """One layout against the 1-process reference on the same packs; with ``ckpt_dir``, also a
    DCP save at step CKPT_STEP resumed by the same layout and by one process."""
    from lmms_parallel import ParallelDims

    spec = get_model_spec(name)
    cfg = _config(name, aux=sp == 1)
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(dp_shard=dp_shard, sp=sp, tp=tp, ep=ep).resolve(world)
    mesh = dims.build_mesh("cpu")
    dp = dims.dp_size
    torch.manual_seed(0)
    ref_model = spec.build(config=cfg, attn_backend="varlen_sdpa")
    vl = images and spec.position_rows > 1
    packs = [
        [_pack(spec, ref_model, 100 * s + d, vl and d % 2 == 0) for d in range(dp)]
        for s in range(STEPS)
    ]  # dp rank d's pack of step s (odd dp ranks text-only: the tower runs a dummy there)
    weights = ref_model.state_dict() if rank == 0 else None

    model = _parallel_model(spec, cfg, mesh, tp=tp, ep=ep, weights=weights)

    group = lp.sp_group(mesh) if sp > 1 else None

    def install(model: nn.Module) -> list[Any]:
        """The vision tower's participation on text-only ranks, and Ulysses SP."""
        handles = []
        tower = spec.vision_tower(model)
        if tower is not None:
            dummy = lambda: spec.dummy_vision_inputs(model, torch.device("cpu"))  # noqa: E731
            part = lp.VisionParticipation(spec.sp_slice_module(model), tower, dummy)
            handles.append(part.install())
        if group is not None:
            spec.set_attention(model, backend="varlen_sdpa", wrapper=lp.UlyssesAttention(group))
            handles.append(lp.SequenceParallel(spec.sp_slice_module(model), group).install())
        return handles

    handles = install(model)
    dp_rank = lp.dp_mesh(mesh).get_local_rank()
    dp_group = lp.dp_mesh(mesh).get_group()
    opt = _optimizer(spec, model, opt_kind)
    losses, grads1, norms = [], None, []

    def step(model: nn.Module, opt: Any, batch: Any) -> float:
        model.forward = lambda b=batch: spec.packed_forward(model, b, sp_group=group)
        loss_sum, n = model(b=batch)
        del model.forward
        total = n.clone()
        dist.all_reduce(total, group=dp_group)
        (loss_sum / total).backward()
        logged = loss_sum.detach().clone()
        dist.all_reduce(logged, group=dp_group)
        nonlocal grads1
        if grads1 is None:
            grads1 = _named_full(model, grads=True)
        norms.append(float(lp.clip_grad_norm_(model.parameters(), CLIP, model=model)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(logged / total)

    ckpt = lp.Checkpointer(ckpt_dir) if ckpt_dir is not None else None
    for s, step_packs in enumerate(packs):
        losses.append(step(model, opt, step_packs[dp_rank]))
        if ckpt is not None and s == CKPT_STEP - 1:
            ckpt.save(CKPT_STEP, model=model, optimizer=opt)
    final = _named_full(model, grads=False)
    resumed: dict[str, Any] = {}
    if ckpt is not None:  # the same layout resumes at CKPT_STEP: the straight run's next steps
        again = _parallel_model(spec, cfg, mesh, tp=tp, ep=ep, weights=weights, seed=1)
        handles += install(again)
        opt2 = _optimizer(spec, again, opt_kind)
        ckpt.load(model=again, optimizer=opt2)
        resumed["losses"] = [step(again, opt2, p[dp_rank]) for p in packs[CKPT_STEP:]]
        resumed["param_err"] = _rel_err(_named_full(again, grads=False), final)[0]
        del norms[STEPS:]
        # ... and one process (EP 1 / TP 1) resumes from the same checkpoint
        one = dist.new_group([0])
        if rank == 0:
            resumed.update(_resume_one_process(name, cfg, packs, opt_kind, ckpt, one, final))
        dist.barrier()
    exported = lp.gather_full_state_dict(model)  # what export_hf writes (rank 0)
    for h in handles:
        h.remove()
    out: dict[str, Any] = {"losses": losses, "norms": norms, "resumed": resumed}
    if rank == 0:
        ref_losses, ref_g, ref_p, ref_norms = _reference(name, cfg, packs, opt_kind)
        out.update(ref_norms=ref_norms)
        # the export holds every parameter, whole, equal to this run's own (gathered) values
        out["export_err"] = max(
            float((exported[k].float() - final[k].float()).abs().max()) for k in final
        )
        out["export_keys_ok"] = set(final) <= set(exported) and all(
            exported[k].shape == ref_p[k].shape for k in final
        )
        out.update(
            ref=ref_losses, grad_err=_rel_err(grads1, ref_g), param_err=_rel_err(final, ref_p)
        )
    return out


def ep_zero_tokens(_out: Path) -> dict[str, Any]:
    """One experts module under EP 2: every token routed to rank 0's experts (rank 1 receives
    nothing), then uneven routing; outputs and gradients == the whole module's."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4)
    cfg._experts_implementation = "eager"  # upstream loop on each rank's local experts
    torch.manual_seed(0)
    full = Qwen3MoeExperts(cfg)
    for p in full.parameters():
        nn.init.normal_(p, std=0.3)
    mine = Qwen3MoeExperts(cfg)
    mine.load_state_dict(full.state_dict())
    lp.ExpertParallel(dist.group.WORLD).apply(mine)
    rank = dist.get_rank()
    errs = {}
    for case, high in (("zero", 2), ("uneven", 4)):
        gen = torch.Generator().manual_seed(7 + rank)
        n = 5 + 4 * rank  # ranks send different numbers of tokens
        x = torch.randn(n, 16, generator=gen)
        idx = torch.stack([torch.randperm(high, generator=gen)[:2] for _ in range(n)])
        w = torch.rand(n, 2, generator=gen)
        full.zero_grad(set_to_none=True)
        mine.zero_grad(set_to_none=True)
        ref = full(x, idx, w)
        ref.pow(2).sum().backward()
        got = mine(x, idx, w)
        got.pow(2).sum().backward()
        sl = lp.ep_local_slice(4, 2, rank)
        g_ref = {k: v.grad for k, v in full.named_parameters()}
        g_got = {k: v.grad for k, v in mine.named_parameters()}
        # expert gradients come from both ranks' tokens: sum the references over ranks
        for k in g_ref:
            dist.all_reduce(g_ref[k])
        errs[case] = {
            "out": float((got - ref).detach().abs().max()),
            "grad": max(float((g_got[k] - g_ref[k][sl]).abs().max()) for k in g_ref),
            "grad_present": all(g is not None for g in g_got.values()),
        }
    return errs


def muon_tp_exact(_out: Path) -> dict[str, Any]:
    """Muon's whole-matrix path for a column-sharded (TP) DTensor update == NS of the whole
    matrix on one process, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lmms_optim import newton_schulz
    from lmms_optim._distributed import orthogonalize_full

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(24, 40, generator=gen).to(torch.bfloat16)
    p = distribute_tensor(torch.zeros(24, 40), mesh, [Shard(1)])
    local = distribute_tensor(full, mesh, [Shard(1)]).to_local()

    def ns(x: torch.Tensor, _key: tuple) -> torch.Tensor:
        return newton_schulz(x, 5)

    got = orthogonalize_full(p, local, (5, None), ns)
    ref = distribute_tensor(ns(full[None], ())[0], mesh, [Shard(1)]).to_local()
    return {
        "max_diff": float((got.float() - ref.float()).abs().max()),
        "shard_rows": got.shape[0], "shard_cols": got.shape[1], "full_rows": 24, "full_cols": 40,
    }  # fmt: skip


#: scenario -> run_case keyword arguments (None: a function of its own)
SCENARIOS: dict[str, dict[str, Any] | None] = {
    "ep_zero_tokens": None,
    "muon_tp_exact": None,
    "ep2_vl_adamw": dict(name="qwen3_vl_moe", ep=2, ckpt=True),
    "ep2_moe_muon": dict(name="qwen3_moe", ep=2, opt_kind="muon", ckpt=True),
    "ep2_sp2_moe": dict(name="qwen3_moe", ep=2, sp=2),
    "ep2_qwen3_5_moe": dict(name="qwen3_5_moe", ep=2),  # another family: the same plan, no code
    "tp2_vl_muon": dict(name="qwen3_vl", tp=2, opt_kind="muon"),
    "ep4_moe": dict(name="qwen3_moe", ep=4),
    "fsdp2_ep2_vl": dict(name="qwen3_vl_moe", ep=2, ckpt=True),
    "tp2_fsdp2_qwen3": dict(name="qwen3", tp=2),
}
WORLD_2 = ["ep_zero_tokens", "muon_tp_exact", "ep2_vl_adamw", "ep2_moe_muon", "ep2_sp2_moe",
           "ep2_qwen3_5_moe", "tp2_vl_muon"]  # fmt: skip
WORLD_4 = ["ep4_moe", "fsdp2_ep2_vl", "tp2_fsdp2_qwen3"]


def run(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    results: dict[str, Any] = {}
    try:
        for name in names:
            kwargs = SCENARIOS[name]
            try:
                if kwargs is None:
                    results[name] = globals()[name](Path(out_dir))
                elif kwargs.pop("ckpt", False):
                    results[name] = run_case(**kwargs, ckpt_dir=Path(out_dir, "ckpt_" + name))
                else:
                    results[name] = run_case(**kwargs)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        Path(out_dir, f"ep_tp_rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
