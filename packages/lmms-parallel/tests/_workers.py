"""Process-group workers for the multi-process tests: many scenarios per spawn (spawns are slow)."""

from __future__ import annotations

import os
from pathlib import Path

import _tiny as T
import torch
import torch.distributed as dist

import lmms_parallel as lp

STEPS = 4


def rows_for(kind: str, n_rows: int, steps: int = STEPS, seed: int = 100, images: bool = True):
    return [
        [T.make_row(kind, seed + 1000 * s + r, images=images) for r in range(n_rows)]
        for s in range(steps)
    ]


def dummy_vision():
    return {"hidden_states": torch.zeros(4, 24), "grid_thw": torch.tensor([[1, 2, 2]])}


def build_parallel(
    kind,
    dims,
    *,
    ac="none",
    param_dtype=None,
    freeze_vision=False,
    source=None,
    meta="lmms",
    cpu_offload=False,
):
    """Meta build -> AC -> FSDP2 -> materialize -> rank-0 load + broadcast."""
    if meta == "lmms":
        with lp.meta_init():
            model = T.build(kind)
    else:  # plain torch meta device: buffers must be recomputed (HF rotary)
        with torch.device("meta"):
            model = T.build(kind)
    mesh = dims.build_mesh("cpu")
    dec, vis, emb = T.blocks(model, kind)
    if freeze_vision:
        model.model.visual.requires_grad_(False)
    lp.apply_activation_checkpointing(dec + vis, ac)
    lp.apply_fsdp(
        model,
        lp.fsdp_mesh(mesh),
        blocks=vis + dec + emb,
        param_dtype=param_dtype,
        cpu_offload=cpu_offload,
    )
    lp.materialize(model, "cpu")
    if dist.get_rank() == 0 and source is None:
        source = T.build(kind, seed=0).state_dict()
    lp.load_full_state_dict(model, source if dist.get_rank() == 0 else None)
    return model, mesh


def train(model, mesh, kind, rows_per_step, opt, *, steps, start=0):
    """Each data-parallel rank takes its contiguous share of every step's rows."""
    sp = mesh["sp"].size()
    group = lp.sp_group(mesh) if sp > 1 else None
    dp = lp.dp_mesh(mesh)
    dp_size, dp_rank = dp.size(), dp.get_local_rank()
    losses = []
    for step in range(start, steps):
        rows = rows_per_step[step]
        k = len(rows) // dp_size
        mine = rows[dp_rank * k : (dp_rank + 1) * k]
        sums, count = [], torch.tensor(0)
        for row in mine:
            s, n = T.row_loss(model, row, group)
            sums.append(s)
            count = count + n
        if group is not None and dp_size == 1:
            s_all, n_all = lp.sp_reduce_loss(sum(sums), count, group)
            loss = s_all / n_all
            value = float(loss)
        else:
            total = count.clone()
            dist.all_reduce(total)
            loss = sum(sums) / total
            logged = sum(sums).detach().clone()
            dist.all_reduce(logged)
            value = float(logged / total)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value)
    return losses


def adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _run(out_dir, scenarios):
    """The scenarios in order, all ranks meeting after each (`LMMS_PARALLEL_ONLY=a,b`: only
    those); the first that raises stops the spawn (later ones may read its checkpoints)."""
    T.register_attention()
    results = {}
    only = os.environ.get("LMMS_PARALLEL_ONLY")
    for name, fn in scenarios:
        if only and name not in only.split(","):
            continue
        results[name] = fn(Path(out_dir))
        dist.barrier()
    return results


# ---------------------------------------------------------------- 4 ranks


def s4_fsdp_qwen3_ckpt(out: Path):
    """1-D FSDP over 4 ranks vs single process; checkpoint after step 2 for the 2-rank resume."""
    rows = rows_for("qwen3", 4)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(T.build("qwen3", seed=0).state_dict(), str(out / "init.safetensors"))
    dist.barrier()
    model, mesh = build_parallel(
        "qwen3", lp.ParallelDims(dp_shard=4), source=out / "init.safetensors"
    )
    opt = adamw(model)
    ckpt = lp.Checkpointer(out / "ckpt4", keep_last=2)
    losses = train(model, mesh, "qwen3", rows, opt, steps=2)
    ckpt.save(1, model=model, optimizer=opt, extra_state={"step": 2})
    ckpt.save(2, model=model, optimizer=opt, extra_state={"step": 2, "rng": torch.get_rng_state()})
    losses += train(model, mesh, "qwen3", rows, opt, steps=STEPS, start=2)
    ref = T.reference_losses("qwen3", rows) if dist.get_rank() == 0 else None
    return {"losses": losses, "ref": ref, "steps": ckpt.steps()}


def s4_hsdp_vl(out: Path):
    """2x2 HSDP on Qwen2.5-VL with full activation checkpointing, plain torch meta build."""
    rows = rows_for("vl", 4)
    model, mesh = build_parallel(
        "vl", lp.ParallelDims(dp_replicate=2, dp_shard=2), ac="full", meta="torch"
    )
    inv = model.model.language_model.rotary_emb.inv_freq.clone()
    losses = train(model, mesh, "vl", rows, adamw(model), steps=STEPS)
    ref_model = T.build("vl", seed=0)
    ok_buf = bool(torch.equal(inv, ref_model.model.language_model.rotary_emb.inv_freq))
    ok_vis = bool(
        torch.equal(
            model.model.visual.rotary_pos_emb.inv_freq,
            ref_model.model.visual.rotary_pos_emb.inv_freq,
        )
    )
    ref = T.reference_losses("vl", rows) if dist.get_rank() == 0 else None
    return {"losses": losses, "ref": ref, "inv_freq_ok": ok_buf and ok_vis}


def _sp_case(kind, sp, ac):
    rows = rows_for(kind, 1, seed=300)
    model, mesh = build_parallel(kind, lp.ParallelDims(dp_shard=-1, sp=sp), ac=ac)
    group = lp.sp_group(mesh)
    T.STATE.wrapper = lp.UlyssesAttention(group)
    handle = lp.SequenceParallel(T.sp_module(model, kind), group).install()
    try:
        losses = train(model, mesh, kind, rows, adamw(model), steps=STEPS)
    finally:
        handle.remove()
        T.STATE.wrapper = None
    ref = T.reference_losses(kind, rows) if dist.get_rank() == 0 else None
    return {"losses": losses, "ref": ref, "lengths": [r[0]["input_ids"].numel() for r in rows]}


def s_sp_vl(out: Path):
    return _sp_case("vl", dist.get_world_size(), "selective")


def s_sp_qwen3(out: Path):
    return _sp_case("qwen3", dist.get_world_size(), "none")


SP_SCENARIOS = [("sp_vl", s_sp_vl), ("sp_qwen3", s_sp_qwen3)]  # on 4 and on 2 ranks
SCENARIOS_4 = [("fsdp_qwen3", s4_fsdp_qwen3_ckpt), ("hsdp_vl", s4_hsdp_vl), *SP_SCENARIOS]


def run4(rank, world, out_dir):
    return _run(out_dir, SCENARIOS_4)


# ---------------------------------------------------------------- 2 ranks


def s2_reshard_resume(out: Path):
    """Load the 4-rank checkpoint on 2 ranks and continue: same losses as the 4-rank run."""
    rows = rows_for("qwen3", 4)
    model, mesh = build_parallel("qwen3", lp.ParallelDims(dp_shard=2))
    opt = adamw(model)
    train(model, mesh, "qwen3", rows, opt, steps=1)  # make state differ from the checkpoint
    ckpt = lp.Checkpointer(out / "ckpt4")
    extra = ckpt.load(model=model, optimizer=opt)
    losses = train(model, mesh, "qwen3", rows, opt, steps=STEPS, start=int(extra["step"]))
    return {
        "losses": losses,
        "step": int(extra["step"]),
        "rng_ok": extra["rng"].dtype == torch.uint8,
    }


def _muon(model):
    try:
        from lmms_optim import Muon
    except ImportError:
        return adamw(model), "adamw"
    return Muon(model.parameters(), lr=0.02, adamw_lr=1e-3), "muon"


def s2_resume_muon(out: Path):
    """Same world size: save at step 1 with Muon, resume into a fresh model, same losses."""
    rows = rows_for("vl", 2, seed=500)
    model, mesh = build_parallel("vl", lp.ParallelDims(dp_shard=2))
    opt, name = _muon(model)
    ckpt = lp.Checkpointer(out / "ckpt2", keep_last=1)
    losses = train(model, mesh, "vl", rows, opt, steps=2)
    ckpt.save(2, model=model, optimizer=opt, extra_state={"step": 2})  # "step" = next step
    losses += train(model, mesh, "vl", rows, opt, steps=STEPS, start=2)
    model2, mesh2 = build_parallel("vl", lp.ParallelDims(dp_shard=2))
    opt2, _ = _muon(model2)
    extra = ckpt.load(model=model2, optimizer=opt2)
    resumed = train(model2, mesh2, "vl", rows, opt2, steps=STEPS, start=int(extra["step"]))
    return {"losses": losses, "resumed": resumed, "optimizer": name}


def s2_vision_participation(out: Path):
    """Rank 0 has images, rank 1 text only: no hang, same losses as the single process.

    Qwen2.5-VL (merger in the root unit) and Qwen3-VL (deepstack mergers too): the dummy tower
    call must give every parameter a real image reaches a gradient, or the root unit's
    reduce-scatter differs in size between the ranks (gloo: collective mismatch).
    """
    result = {}
    for kind in ("vl", "vl3"):
        rows = [
            [T.make_row(kind, 700 + 10 * s), T.make_row(kind, 701 + 10 * s, images=False)]
            for s in range(3)
        ]
        model, mesh = build_parallel(kind, lp.ParallelDims(dp_shard=2))
        vp = lp.VisionParticipation(
            model.model.language_model, model.model.visual, dummy_vision
        ).install()
        try:
            losses = train(model, mesh, kind, rows, adamw(model), steps=3)
        finally:
            vp.remove()
        ref = T.reference_losses(kind, rows) if dist.get_rank() == 0 else None
        has_pixels = ["pixel_values" in r for r in rows[0]]
        result[kind] = {"losses": losses, "ref": ref, "has_pixels": has_pixels}
    return result


def s2_export_vl(out: Path):
    """Train 3 steps under FSDP2, export, load with from_pretrained: same loss as the reference."""
    rows = [[T.make_row("vl", 700 + 10 * s), T.make_row("vl", 701 + 10 * s)] for s in range(3)]
    model, mesh = build_parallel("vl", lp.ParallelDims(dp_shard=2))
    train(model, mesh, "vl", rows, adamw(model), steps=3)
    lp.export_hf(model, out / "hf_vl")
    result = {}
    if dist.get_rank() == 0:
        from transformers import Qwen2_5_VLForConditionalGeneration

        loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "hf_vl")
        T.set_attention(loaded)
        ref_model = T.build("vl", seed=0)
        opt = adamw(ref_model)
        for step_rows in rows:  # the reference after the same 3 steps
            sums = [T.row_loss(ref_model, r) for r in step_rows]
            (sum(s for s, _ in sums) / sum(int(n) for _, n in sums)).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            probe = rows[0][0]
            a, _ = T.row_loss(loaded, probe)
            b, _ = T.row_loss(ref_model, probe)
        result["export_loss"] = [float(a), float(b)]
    return result


def s2_export_qwen3(out: Path):
    model, _ = build_parallel("qwen3", lp.ParallelDims(dp_shard=2))
    lp.export_hf(model, out / "hf_qwen3")
    if dist.get_rank() != 0:
        return {}
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out / "hf_qwen3")
    ref = T.build("qwen3", seed=0)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (loaded(ids).logits - ref(ids).logits).abs().max()
    return {"max_logit_diff": float(diff)}


def s2_frozen_vision_bf16(out: Path):
    """Vision tower frozen under bf16 mixed precision: trains, vision weights unchanged."""
    rows = rows_for("vl", 2, steps=2, seed=900)
    model, mesh = build_parallel(
        "vl", lp.ParallelDims(dp_shard=2), param_dtype=torch.bfloat16, freeze_vision=True
    )
    before = model.model.visual.blocks[0].attn.qkv.weight.to_local().clone()
    lm_before = model.model.language_model.layers[0].mlp.up_proj.weight.to_local().clone()
    losses = train(model, mesh, "vl", rows, adamw(model), steps=2)
    after = model.model.visual.blocks[0].attn.qkv.weight.to_local()
    lm_after = model.model.language_model.layers[0].mlp.up_proj.weight.to_local()
    ref = T.reference_losses("vl", rows) if dist.get_rank() == 0 else None
    return {
        "losses": losses,
        "ref": ref,
        "vision_unchanged": bool(torch.equal(before, after)),
        "lm_changed": not bool(torch.equal(lm_before, lm_after)),
    }


def s2_cpu_offload(out: Path):
    """FSDP2 with CPU offload (sharded params, grads and optimizer state on the host)."""
    rows = rows_for("qwen3", 2, steps=3, seed=1300)
    model, mesh = build_parallel("qwen3", lp.ParallelDims(dp_shard=2), cpu_offload=True)
    from torch.distributed.fsdp import CPUOffloadPolicy

    group = model.model.layers[0]._get_fsdp_state()._fsdp_param_group  # private: test-only check
    assert isinstance(group.offload_policy, CPUOffloadPolicy), group.offload_policy
    losses = train(model, mesh, "qwen3", rows, adamw(model), steps=3)
    ref = T.reference_losses("qwen3", rows) if dist.get_rank() == 0 else None
    return {"losses": losses, "ref": ref}


def s2_save_fails_on_one_rank(out: Path):
    """Rank 1's write fails as on a full disk during the second save: every rank raises (none
    waits at a barrier), the partial .tmp is gone and the first checkpoint is untouched."""
    import errno
    from unittest import mock

    model, _ = build_parallel("qwen3", lp.ParallelDims(dp_shard=2))
    ckpt = lp.Checkpointer(out / "ckpt_fail", keep_last=3)
    ckpt.save(1, model=model, extra_state={"step": 1})
    before = sorted(os.listdir(ckpt.path(1)))
    real = Path.write_bytes

    def full_on_rank1(self, data):
        if self.name == "extra_rank1.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data)

    raised = None
    with mock.patch.object(Path, "write_bytes", full_on_rank1):
        try:
            ckpt.save(2, model=model, extra_state={"step": 2})
        except (OSError, RuntimeError) as exc:
            raised = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return {
        "raised": raised,
        "left": sorted(os.listdir(out / "ckpt_fail")),
        "first_intact": sorted(os.listdir(ckpt.path(1))) == before,
    }


SCENARIOS_2 = [
    ("save_fails_on_one_rank", s2_save_fails_on_one_rank),
    ("cpu_offload", s2_cpu_offload),
    ("reshard_resume", s2_reshard_resume),
    ("resume_muon", s2_resume_muon),
    ("export_vl", s2_export_vl),
    ("export_qwen3", s2_export_qwen3),
    ("frozen_vision_bf16", s2_frozen_vision_bf16),
    ("vision_participation", s2_vision_participation),
    *SP_SCENARIOS,
]


def run2(rank, world, out_dir):
    return _run(out_dir, SCENARIOS_2)
