"""Workers of test_ep_tp.py: expert and tensor parallelism (gloo, CPU) against one process.

Every scenario builds the tiny upstream model on the meta device, applies the spec's plans from
outside in the trainer's order (TP/EP, then FSDP2 with the experts as their own units), loads
rank 0's weights, and trains three optimizer steps; rank 0 runs the same packs through the plain
model in the same process. Results (losses, step-1 gradient errors, final parameter errors) go
to per-rank JSON files the tests read. One spawn per world size runs every scenario.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _tp_sp_deepstack import sp_deepstack_forms  # noqa: F401  (a scenario: run() finds it here)
from torch import nn

import lmms_parallel as lp
from lmms_models import get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples
from lmms_parallel.testing import init_gloo

STEPS = 3
CKPT_STEP = 2  # scenarios with a checkpoint save after this step and resume from it
CLIP = 1.0  # global-norm clipping (the tiny models' gradients exceed it at first)


def _pack(spec, model, seed: int, image: bool, n: int = 3, image_last: bool = False):
    """``n`` samples, the first with a 4-token image (``image_last``: the last, with 16 image
    tokens that straddle the middle of the pack: both halves hold some under TP 2 + SP)."""
    gen = torch.Generator().manual_seed(seed)
    ss = [SampleSpec(text=5 + (seed + i) % 7, prompt=1) for i in range(n)]
    if image and image_last:
        ss[-1] = SampleSpec(text=4, images=[(1, 8, 8)])
    elif image:
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


def _parallel_model(
    spec, cfg, mesh, *, tp: int, ep: int, weights, seed: int = 0, load: bool = True, tp_sp=False
) -> nn.Module:
    """The trainer's order: meta build, TP/EP plans, FSDP2 (experts as their own units),
    materialise, rank 0's weights (``load=False``: a checkpoint brings them)."""
    torch.manual_seed(seed)
    with lp.meta_init():
        model = spec.build(config=cfg, device="meta", attn_backend="varlen_sdpa")
    if hasattr(spec, "set_experts"):
        spec.set_experts(model, "grouped")
    units = []
    if tp > 1:
        spec.check_tp(model.config, tp)
        plan = spec.tp_sp_plan if tp_sp else spec.tp_plan  # tp_sp: sequence-parallel norms
        lp.apply_tp(spec.plan_root(model), plan, lp.tp_mesh(mesh), styles=spec.plan_styles())
        lp.apply_tp(model, spec.tp_head_plan, lp.tp_mesh(mesh))  # vocab-parallel head and loss
    if ep > 1:
        em = lp.expert_meshes(mesh, ep)
        lp.apply_ep(spec.plan_root(model), spec.ep_plan, em.ep_group)
        units = [(m, em.fsdp) for m in spec.experts_modules(model)]
    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model) + spec.embeddings(model)
    lp.apply_fsdp(model, lp.fsdp_mesh(mesh), blocks=blocks, param_dtype=None, units=units)
    lp.materialize(model, "cpu")
    if load:
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


def _install(spec, model: nn.Module, group: Any) -> list[Any]:
    """The vision tower's participation on text-only ranks, and Ulysses SP (``group``)."""
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


def _n_loss_tokens(batch: dict[str, Any]) -> torch.Tensor:
    from lmms_models import shift_labels_packed

    return (shift_labels_packed(batch["labels"].reshape(-1), batch["cu_seqlens"]) != -100).sum()


def _step(spec, model, opt, batches: list[Any], *, sp_group, dp_group, on_grads=None) -> tuple:
    """One optimizer step over this rank's micro-batches ``batches``: each backward divides by
    the global loss-token count (all micro-batches, all DP ranks). Returns ``(loss, norm)``."""
    total = sum(_n_loss_tokens(b) for b in batches).clone()
    dist.all_reduce(total, group=dp_group)
    logged = torch.zeros(())
    for batch in batches:  # through the root module's call, so FSDP2's hooks run
        model.forward = lambda b=batch: spec.packed_forward(model, b, sp_group=sp_group)
        loss_sum, _n = model(b=batch)
        del model.forward
        (loss_sum / total).backward()
        logged += loss_sum.detach()
    dist.all_reduce(logged, group=dp_group)
    if on_grads is not None:
        on_grads(model)
    norm = float(lp.clip_grad_norm_(model.parameters(), CLIP, model=model))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(logged / total), norm


def _export_check(spec, cfg, model: nn.Module, final: dict, out: Path) -> dict[str, Any]:
    """The trainer's export path (``lmms_train._export.export_run``, rank 0 writes), loaded back
    by transformers' Auto class on rank 0: every weight equals the run's own (gathered) and the
    logits on a text row equal those of one process holding those weights, same class and code."""
    from lmms_train._export import auto_class_for, export_run

    path = export_run(model, out, weights=None, processor_path=None)
    if dist.get_rank() != 0:
        return {}
    auto = auto_class_for(model.config, spec.model_class)
    loaded = auto.from_pretrained(str(path), attn_implementation="eager").eval()
    ref = type(loaded)._from_config(loaded.config, attn_implementation="eager").eval()
    ref.load_state_dict(final, strict=True)
    got = {k: v.detach() for k, v in loaded.named_parameters()}
    w_err = max(float((got[k] - final[k]).abs().max()) for k in final)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits_err = float((loaded(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
    return {"hf_class": type(loaded).__name__, "weights_err": w_err, "logits_err": logits_err,
            "same_keys": set(got) == set(final)}  # fmt: skip


def run_case(
    name: str, *, tp=1, ep=1, sp=1, dp_shard=-1, opt_kind="adamw", images=True, ckpt_dir=None,
    export_dir=None, regroup=None, scenario="", tp_sp=False, image_last=False,
):  # fmt: skip
    """One layout against the 1-process reference on the same packs; with ``ckpt_dir``, also a
    DCP save at step CKPT_STEP resumed by the same layout and by one process (``regroup``: the
    degrees a 2-rank stage resumes at, after the spawn's scenarios: :func:`resume_regrouped`);
    with ``export_dir``, the trainer's HF export loaded by transformers (:func:`_export_check`)."""
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
        [
            _pack(spec, ref_model, 100 * s + d, vl and d % 2 == 0, image_last=image_last)
            for d in range(dp)
        ]
        for s in range(STEPS)
    ]  # dp rank d's pack of step s (odd dp ranks text-only: the tower runs a dummy there)
    weights = ref_model.state_dict() if rank == 0 else None

    model = _parallel_model(spec, cfg, mesh, tp=tp, ep=ep, weights=weights, tp_sp=tp_sp)
    group = lp.sp_group(mesh) if sp > 1 else None
    handles = _install(spec, model, group)
    dp_rank = lp.dp_mesh(mesh).get_local_rank()
    dp_group = lp.dp_mesh(mesh).get_group()
    opt = _optimizer(spec, model, opt_kind)
    losses, grads1, norms = [], [], []

    def first_grads(model: nn.Module) -> None:
        if not grads1:
            grads1.append(_named_full(model, grads=True))

    ckpt = lp.Checkpointer(ckpt_dir) if ckpt_dir is not None else None
    for s, step_packs in enumerate(packs):
        loss, norm = _step(spec, model, opt, [step_packs[dp_rank]], sp_group=group,
                           dp_group=dp_group, on_grads=first_grads)  # fmt: skip
        losses.append(loss)
        norms.append(norm)
        if ckpt is not None and s == CKPT_STEP - 1:
            ckpt.save(CKPT_STEP, model=model, optimizer=opt)
    final = _named_full(model, grads=False)
    resumed: dict[str, Any] = {}
    t0 = time.perf_counter()
    if ckpt is not None:  # the same layout resumes at CKPT_STEP: the straight run's next steps
        again = _parallel_model(spec, cfg, mesh, tp=tp, ep=ep, weights=weights, seed=1, tp_sp=tp_sp)
        handles += _install(spec, again, group)
        opt2 = _optimizer(spec, again, opt_kind)
        ckpt.load(model=again, optimizer=opt2)
        resumed["losses"] = [
            _step(spec, again, opt2, [p[dp_rank]], sp_group=group, dp_group=dp_group)[0]
            for p in packs[CKPT_STEP:]
        ]
        resumed["param_err"] = _rel_err(_named_full(again, grads=False), final)[0]
        # ... and one process (EP 1 / TP 1) resumes from the same checkpoint
        one = dist.new_group([0])
        if rank == 0:
            resumed.update(_resume_one_process(name, cfg, packs, opt_kind, ckpt, one, final))
        dist.barrier()
        if regroup is not None:  # what the 2-rank stage needs
            _REGROUP[scenario] = dict(name=name, cfg=cfg, packs=packs, opt_kind=opt_kind, ckpt=ckpt,
                                  final=final, straight=losses[CKPT_STEP:], **regroup)  # fmt: skip
    t1 = time.perf_counter()
    exported = lp.gather_full_state_dict(model)  # what export_hf writes (rank 0)
    export = _export_check(spec, cfg, model, final, export_dir) if export_dir else {}
    seconds = {"resume": t1 - t0, "export": time.perf_counter() - t1}
    for h in handles:
        h.remove()
    out: dict[str, Any] = {"losses": losses, "norms": norms, "resumed": resumed, "export": export,
                           "seconds": seconds}  # fmt: skip
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
            ref=ref_losses, grad_err=_rel_err(grads1[0], ref_g), param_err=_rel_err(final, ref_p)
        )
    return out


#: scenario -> what its 2-rank stage needs (filled by run_case on the 4-rank world)
_REGROUP: dict[str, dict[str, Any]] = {}


def resume_regrouped(name, cfg, packs, opt_kind, ckpt, final, straight, tp=1, ep=1):
    """Ranks 0 and 1 of a 4-rank spawn, in a new 2-rank process group: the 4-rank layout's
    checkpoint resumes at degrees ``tp`` / ``ep`` on 2 ranks (e.g. EP 4 -> 2 and FSDP 4 -> 2).
    Each rank takes the packs of two former DP ranks as micro-batches (the step's global batch
    is the same), so the losses must be the straight run's."""
    from lmms_parallel import ParallelDims

    spec = get_model_spec(name)
    dims = ParallelDims(tp=tp, ep=ep).resolve(dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    model = _parallel_model(spec, cfg, mesh, tp=tp, ep=ep, weights=None, seed=1, load=False)
    handles = _install(spec, model, None)
    opt = _optimizer(spec, model, opt_kind)
    ckpt.load(model=model, optimizer=opt)
    dp_rank, dp_group = lp.dp_mesh(mesh).get_local_rank(), lp.dp_mesh(mesh).get_group()
    per = len(packs[0]) // dims.dp_size  # former DP ranks per rank
    losses = [
        _step(spec, model, opt, p[dp_rank * per : (dp_rank + 1) * per], sp_group=None,
              dp_group=dp_group)[0]
        for p in packs[CKPT_STEP:]
    ]  # fmt: skip
    err = _rel_err(_named_full(model, grads=False), final)[0]
    for h in handles:
        h.remove()
    return {"losses": losses, "straight": straight, "param_err": err, "tp": tp, "ep": ep,
            "dp_shard": dims.dp_shard}  # fmt: skip


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


def vocab_parallel_ce(_out: Path) -> dict[str, Any]:
    """The vocab-parallel head and loss on 2 ranks against the whole logits on one: loss and
    gradients (hidden, weight rows, bias) == torch's cross-entropy in fp32 order; odd sizes,
    ignored labels, labels on both ranks' rows, chunks smaller than T; a direct call of the
    head returns the whole logits."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(11)
    t, h, v = 37, 24, 50
    hidden = torch.randn(t, h, generator=gen)
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[::5] = -100
    head = nn.Linear(h, v, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=gen) * 2)  # confident logits
        head.bias.copy_(torch.randn(v, generator=gen))
    ref_h = hidden.clone().requires_grad_()
    ref_w, ref_b = head.weight.detach().clone(), head.bias.detach().clone()
    ref_w.requires_grad_()
    ref_b.requires_grad_()
    ref = F.cross_entropy(F.linear(ref_h, ref_w, ref_b), labels, reduction="sum")
    (ref * 0.37).backward()
    lp.apply_tp(nn.ModuleDict({"lm_head": head}), {"lm_head": "vocab_parallel"}, mesh)
    whole = float((head(hidden) - F.linear(hidden, ref_w, ref_b)).abs().max())
    got_h = hidden.clone().requires_grad_()
    w, group, start = lp.vocab_parallel_shard(head.weight)
    loss, n = lp.vocab_parallel_cross_entropy(
        got_h, w, labels, group=group, start=start, bias=head.bias.to_local(), chunk=8
    )
    (loss * 0.37).backward()
    rows = slice(start, start + w.shape[0])
    return {
        "loss": float(loss), "ref": float(ref), "n": int(n), "ref_n": int((labels >= 0).sum()),
        "g_hidden": float((got_h.grad - ref_h.grad).abs().max()),
        "g_weight": float((head.weight.grad.to_local() - ref_w.grad[rows]).abs().max()),
        "g_bias": float((head.bias.grad.to_local() - ref_b.grad[rows]).abs().max()),
        "whole_logits": whole,
    }  # fmt: skip


#: scenario -> run_case keyword arguments (None: a function of its own); ``ckpt``: save and
#: resume (same layout, one process); ``export``: the HF export check; ``regroup``: the degrees a
#: 2-rank stage resumes the 4-rank checkpoint at
SCENARIOS: dict[str, dict[str, Any] | None] = {
    "ep_zero_tokens": None,
    "muon_tp_exact": None,
    "vocab_parallel_ce": None,
    "sp_deepstack_forms": None,
    "ep2_vl_adamw": dict(name="qwen3_vl_moe", ep=2, ckpt=True),
    "ep2_moe_muon": dict(name="qwen3_moe", ep=2, opt_kind="muon", ckpt=True),
    "ep2_sp2_moe": dict(name="qwen3_moe", ep=2, sp=2),
    "ep2_qwen3_5_moe": dict(name="qwen3_5_moe", ep=2),  # another family: the same plan, no code
    "tp2_sp_qwen2_5_vl": dict(name="qwen2_5_vl", tp=2, tp_sp=True),  # SP norms, VL merge, odd T
    # SP norms with deepstack: image tokens on both ranks' rows (sp_deepstack)
    "tp2_sp_qwen3_vl": dict(name="qwen3_vl", tp=2, tp_sp=True, image_last=True),
    "tp2_vl_muon": dict(name="qwen3_vl", tp=2, opt_kind="muon", ckpt=True, export=True),
    "ep4_moe": dict(name="qwen3_moe", ep=4, ckpt=True, regroup=dict(ep=2)),  # EP 4->2, FSDP 4->2
    "fsdp2_ep2_vl": dict(name="qwen3_vl_moe", ep=2, ckpt=True, export=True),
    "tp2_fsdp2_qwen3": dict(
        name="qwen3", tp=2, tp_sp=True, ckpt=True, regroup=dict(tp=1)
    ),  # TP2xFSDP2 -> FSDP2
}
WORLD_2 = ["ep_zero_tokens", "muon_tp_exact", "vocab_parallel_ce", "sp_deepstack_forms", "ep2_vl_adamw", "ep2_moe_muon", "ep2_sp2_moe",
           "ep2_qwen3_5_moe", "tp2_vl_muon", "tp2_sp_qwen2_5_vl", "tp2_sp_qwen3_vl"]  # fmt: skip
WORLD_4 = ["ep4_moe", "fsdp2_ep2_vl", "tp2_fsdp2_qwen3"]


def run(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> dict[str, Any]:
    """Every scenario of ``names`` on the spawn's ``world``-rank group; then, where scenarios
    asked for it, ranks 0 and 1 form a new 2-rank group (store on ``port``) and resume their
    checkpoints."""
    results: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception:  # recorded for the test; printed now, as the other ranks may hang
            error = traceback.format_exc()
            print(f"rank {rank} {name}:", error, flush=True)
            return {"error": error}

    for name in names:
        kwargs = dict(SCENARIOS[name] or {})
        if SCENARIOS[name] is None:
            results[name] = attempt(name, lambda n=name: globals()[n](Path(out_dir)))
        else:
            t0 = time.perf_counter()
            for key in ("ckpt", "export"):
                if kwargs.pop(key, False):
                    kwargs[key + "_dir"] = Path(out_dir, f"{key}_{name}")
            results[name] = attempt(name, lambda kw=kwargs, n=name: run_case(**kw, scenario=n))
            if "seconds" in results[name]:
                results[name]["seconds"]["total"] = time.perf_counter() - t0
        dist.barrier()
    if any(SCENARIOS[n] and "regroup" in SCENARIOS[n] for n in names):
        dist.destroy_process_group()
        if rank < 2:
            init_gloo(rank, 2, port, timeout_s=120)
            for name in names:
                if name in _REGROUP:
                    fn = lambda n=name: resume_regrouped(**_REGROUP[n])  # noqa: E731
                    t0 = time.perf_counter()
                    results[name]["regrouped"] = attempt(name, fn)
                    results[name]["seconds"]["regroup"] = time.perf_counter() - t0
                    dist.barrier()
    return results
