"""One process computes in bf16 from fp32 masters without FSDP2 (`MasterWeights`), or with
`fsdp: true` through the FSDP2 path of torchrun (MixedPrecisionPolicy): the same numbers, bit for
bit; the steady-state step never waits for the device."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from e2e_helpers import tiny_config

import lmms_train._loop as loop
import lmms_train._trainer as trainer
from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.config import config_from_dict

_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in _TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def _spy_runs(monkeypatch) -> list[dict]:
    """Record what the loop gets in each run: parameter types, what the optimizer steps,
    compute dtype of a block."""
    runs: list[dict] = []
    original = trainer.train_loop

    def spy(run):
        from torch.distributed.tensor import DTensor

        seen: dict = {"block_dtypes": set()}
        runs.append(seen)
        seen["dtensor"] = all(isinstance(p, DTensor) for p in run.model.parameters())
        seen["master"] = {p.dtype for p in run.model.parameters()}
        seen["stepped"] = {p.dtype for g in run.optimizer.param_groups for p in g["params"]}
        block = run.spec.decoder_blocks(run.model)[0]
        linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))

        def hook(mod, args):  # inside the block: FSDP2 has swapped in the compute weight
            seen["block_dtypes"].add(mod.weight.dtype)

        linear.register_forward_pre_hook(hook)
        seen["group"] = torch.distributed.is_initialized()
        return original(run)

    monkeypatch.setattr(trainer, "train_loop", spy)
    return runs


def test_master_weights_equal_fsdp2_mixed_precision(
    tiny_inputs, tmp_path, monkeypatch, no_torchrun
):
    """bf16 on one process: `fsdp: true` goes through FSDP2 (DTensor parameters on a 1-rank
    group, destroyed after the run; fp32 masters, bf16 compute in the blocks); `fsdp: false` and
    the default (null) train a bf16 module whose fp32 masters the optimizer steps
    (MasterWeights). Both are the same arithmetic (bf16 casts of fp32 masters, gradients
    accumulated over micro-batches in fp32), so losses and grad norms are equal over steps, and a
    checkpoint of either resumes the other exactly."""
    seen = _spy_runs(monkeypatch)
    losses, runs = {}, {}
    for fsdp in (True, False):
        out = runs[fsdp] = tmp_path / f"fsdp_{fsdp}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=4, save_steps=2, save_final=False, bf16=True,
            fsdp=fsdp, gradient_accumulation_steps=2,
        )  # fmt: skip
        train(config_from_dict(cfg))
        assert not torch.distributed.is_initialized()  # the run's own 1-rank group is destroyed
        losses[fsdp] = [
            r[k] for r in read_jsonl(out / "metrics.jsonl") for k in ("loss", "grad_norm")
        ]
    assert len(losses[True]) == 8
    assert losses[False] == losses[True]
    for fsdp in (True, None):  # resume steps 3-4 from the other path's step-2 checkpoint
        out = tmp_path / f"resumed_{fsdp}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=4, save_final=False, bf16=True, fsdp=fsdp,
            gradient_accumulation_steps=2,
            resume_from=str(runs[not fsdp] / "checkpoints" / "step_000002"),
        )  # fmt: skip
        train(config_from_dict(cfg))
        got = [r[k] for r in read_jsonl(out / "metrics.jsonl") for k in ("loss", "grad_norm")]
        assert got == losses[not fsdp][4:], fsdp
    assert len(seen) == 4  # fsdp: true, false, then true and null resumed
    for s in seen[0::2]:  # FSDP2: fp32 DTensors stepped as they are, bf16 inside the blocks
        assert s["group"] and s["dtensor"], s
        assert s["master"] == s["stepped"] == {torch.float32}
        assert torch.bfloat16 in s["block_dtypes"], s["block_dtypes"]
    for s in seen[1::2]:  # a bf16 module, its fp32 masters stepped
        assert not s["group"] and not s["dtensor"], s
        assert s["master"] == s["block_dtypes"] == {torch.bfloat16}
        assert s["stepped"] == {torch.float32}


def test_one_process_fsdp_equals_plain_fp32(tiny_inputs, tmp_path, no_torchrun):
    """fp32 on one process: FSDP2 on a 1-rank group changes nothing in the losses."""
    losses = {}
    for fsdp in (True, False):
        out = tmp_path / f"fsdp_{fsdp}"
        cfg = tiny_config(tiny_inputs, out, max_steps=3, save_final=False, fsdp=fsdp)
        train(config_from_dict(cfg))
        rows = read_jsonl(out / "metrics.jsonl")
        losses[fsdp] = [r[k] for r in rows for k in ("loss", "grad_norm")]
        assert all(r["perf/gc_s"] >= 0.0 and r["perf/gc_full"] >= 0.0 for r in rows)
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=2e-5, abs=1e-6)


@pytest.mark.gpu
def test_master_weights_match_fsdp2_on_the_gpu(tiny_inputs, tmp_path, no_torchrun):
    """The same comparison on a GPU (NCCL one-rank FSDP2, CUDA kernels, fused AdamW): the two
    paths agree to within the kernels' own run-to-run spread (FA4's backward accumulates
    atomically, so bit-identity is not expected)."""
    losses = {}
    for fsdp in (True, None):
        out = tmp_path / f"fsdp_{fsdp}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=4, save_final=False, device="cuda", bf16=True,
            fsdp=fsdp, gradient_accumulation_steps=2,
        )  # fmt: skip
        train(config_from_dict(cfg))
        losses[fsdp] = [
            r[k] for r in read_jsonl(out / "metrics.jsonl") for k in ("loss", "grad_norm")
        ]
    assert losses[None] == pytest.approx(losses[True], rel=2e-3)


def _losses(out) -> list[float]:
    return [r[k] for r in read_jsonl(out / "metrics.jsonl") for k in ("loss", "grad_norm")]


def test_fused_master_step_equals_the_three_passes(tiny_inputs, tmp_path, no_torchrun):
    """`fused_master_step: true` (lmms_optim.MasterAdamW: clip scale and bf16 write-back inside
    the optimizer step) on CPU runs torch's AdamW with the same clip multiply and copies, so
    losses and grad norms equal the three-pass path's bit for bit, with clipping active, and the
    three-pass path resumes the fused path's checkpoint exactly (same optimizer state)."""
    runs, losses = {}, {}
    for fused in (False, True):
        out = runs[fused] = tmp_path / f"fused_{fused}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=4, save_steps=2, save_final=False, bf16=True,
            gradient_accumulation_steps=2, max_grad_norm=0.05, fused_master_step=fused,
        )  # fmt: skip
        train(config_from_dict(cfg))
        losses[fused] = _losses(out)
    assert len(losses[True]) == 8 and all(n > 0.05 for n in losses[True][1::2])  # clipped
    assert losses[True] == losses[False]
    out = tmp_path / "resumed"
    cfg = tiny_config(
        tiny_inputs, out, max_steps=4, save_final=False, bf16=True, max_grad_norm=0.05,
        gradient_accumulation_steps=2, fused_master_step=False,
        resume_from=str(runs[True] / "checkpoints" / "step_000002"),
    )  # fmt: skip
    train(config_from_dict(cfg))
    assert _losses(out) == losses[True][4:]


def test_linear_patch_embed_trains_as_the_convolution(tiny_inputs, tmp_path, no_torchrun):
    """`linear_patch_embed: true` (the VL patch embedding as one GEMM): the same losses and grad
    norms as upstream's Conv3d within fp32 reordering."""
    losses = {}
    for linear in (False, True):
        out = tmp_path / f"linear_{linear}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=3, save_final=False, linear_patch_embed=linear
        )
        train(config_from_dict(cfg))
        losses[linear] = _losses(out)
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)  # grad norms: 1e-5 apart


@pytest.mark.gpu
@pytest.mark.parametrize("ga", [1, 2])
def test_fused_master_step_matches_on_the_gpu(tiny_inputs, tmp_path, no_torchrun, ga):
    """On CUDA the fused step is the Triton kernel (not bit-identical to torch's fused AdamW:
    another rounding order), reading bf16 gradients at GA 1 and fp32 ones at GA 2; losses and
    grad norms agree within the kernels' spread. The fused run then resumes its own step-2
    checkpoint (torch's `load_state_dict` leaves the step counts on the host: the fused step must
    move them) and repeats its last two steps."""
    losses = {}
    for fused in (False, True):
        out = tmp_path / f"fused_{fused}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=4, save_steps=2, save_final=False, device="cuda",
            bf16=True, gradient_accumulation_steps=ga, max_grad_norm=0.05,
            fused_master_step=fused,
        )  # fmt: skip
        train(config_from_dict(cfg))
        losses[fused] = _losses(out)
    assert losses[True] == pytest.approx(losses[False], rel=2e-3)
    out = tmp_path / "resumed"
    cfg = tiny_config(
        tiny_inputs, out, max_steps=4, save_final=False, device="cuda", bf16=True,
        gradient_accumulation_steps=ga, max_grad_norm=0.05,
        resume_from=str(tmp_path / "fused_True" / "checkpoints" / "step_000002"),
    )  # fmt: skip
    train(config_from_dict(cfg))
    assert _losses(out) == pytest.approx(losses[True][4:], rel=2e-3)


def test_a_stalled_step_is_named_on_stderr(tiny_inputs, tmp_path, monkeypatch, no_torchrun, capfd):
    """A step whose host stalls (here a sleep in its micro-batches, as a kernel compiled on first
    use would) is named on stderr with its time against the median."""
    import time

    real = loop.run_micro_batches
    calls = []

    def stalling(**kwargs):
        calls.append(1)
        if len(calls) == 6:
            time.sleep(2.0)
        return real(**kwargs)

    monkeypatch.setattr(loop, "run_micro_batches", stalling)
    cfg = tiny_config(tiny_inputs, tmp_path / "run", max_steps=7, save_final=False)
    train(config_from_dict(cfg))
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "[lmms-train] slow step" in ln]
    named = [ln for ln in lines if ln.startswith("[lmms-train] slow step 6 took ")]
    assert len(named) == 1 and "x the median of the last " in named[0], lines


def test_metrics_are_read_one_step_late_and_packs_one_step_ahead(
    tiny_inputs, tmp_path, monkeypatch, no_torchrun
):
    """The host reads step k's scalars only after step k+1 is queued (the last step at once),
    and each read is one copy: the device is never waited for while it still has work. Each
    step's packs are read during the previous step, after its backward is queued and before its
    optimizer step; the last step reads nothing ahead."""
    order: list[str] = []
    fetch, norm = loop._fetch, loop.grad_norm

    class Recording(loop.PendingScalars):
        def __init__(self, *values):
            super().__init__(*values)
            order.append("queue")
            self.n = order.count("queue")

        def wait(self):
            order.append(f"read {self.n}")
            return super().wait()

    def recording_fetch(*a, **k):
        order.append("packs")
        return fetch(*a, **k)

    def recording_norm(*a, **k):
        order.append("optimizer")
        return norm(*a, **k)

    monkeypatch.setattr(loop, "PendingScalars", Recording)
    monkeypatch.setattr(loop, "_fetch", recording_fetch)
    monkeypatch.setattr(loop, "grad_norm", recording_norm)
    steps = 4
    cfg = tiny_config(
        tiny_inputs, tmp_path / "run", max_steps=steps, save_final=False,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    train(config_from_dict(cfg))
    scalars = [e for e in order if e not in ("packs", "optimizer")]
    assert scalars == [
        "queue", "queue", "read 1", "queue", "read 2", "queue", "read 3", "read 4",
    ], order  # fmt: skip
    reads = [e for e in order if e in ("packs", "optimizer")]
    assert reads == [
        "packs", "packs", "optimizer", "packs", "optimizer", "packs", "optimizer", "optimizer",
    ], order  # fmt: skip
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_profile_steps_write_trace_ops_and_host_waits(tiny_inputs, tmp_path, no_torchrun):
    """`profile_steps: [2, 3]`: the trace, the operator table and the wait summary are written
    for exactly that window."""
    import json

    cfg = tiny_config(tiny_inputs, tmp_path / "run", max_steps=4, save_final=False,
                      profile_steps=[2, 3])  # fmt: skip
    train(config_from_dict(cfg))
    prof = tmp_path / "run" / "profile"
    assert sorted(p.name for p in prof.iterdir()) == [
        "ops_rank0.txt", "syncs_rank0.json", "trace_rank0.json.gz",
    ]  # fmt: skip
    summary = json.loads((prof / "syncs_rank0.json").read_text())
    assert summary["steps"] == [2, 3]
    assert set(summary["totals"]) == {"event_wait", "sync"}
    if not torch.cuda.is_available():  # CPU runs have no device to wait for
        assert summary["sites"] == [] and summary["totals"]["sync"]["count"] == 0
    assert "Self CPU" in (prof / "ops_rank0.txt").read_text()
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_wait_summary_points_at_the_line_that_read_a_scalar():
    from torch.profiler import ProfilerActivity, profile

    from lmms_train._profile import summarize_waits

    def culprit(t):
        return t.sum().item()

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        culprit(torch.ones(4))
    # on CPU no CUDA call waits, so attribute the scalar read itself (the op a sync sits under)
    summary = summarize_waits(prof.events(), kinds={"aten::_local_scalar_dense": "read"})
    assert summary["totals"]["read"]["count"] == 1
    (site,) = summary["sites"]
    assert site["op"] == "aten::item" and "culprit" in site["site"][0], site


def test_trainer_places_media_without_upstream_device_reads(
    tiny_inputs, tmp_path, monkeypatch, no_torchrun
):
    """The trainer's Qwen2.5-VL step places the image features from host positions (the data
    carries `mm_token_type_ids`, kept on the host): upstream's `get_placeholder_mask` (a device
    count check) is never called."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as upstream

    def refuse(*_a, **_k):
        raise AssertionError("upstream placeholder merge reached")

    monkeypatch.setattr(upstream.Qwen2_5_VLModel, "get_placeholder_mask", refuse)
    cfg = tiny_config(tiny_inputs, tmp_path / "run", max_steps=2, save_final=False)
    last = train(config_from_dict(cfg))
    assert torch.isfinite(torch.tensor(last["loss"]))


def test_sync_log_names_the_line_that_synchronised():
    """The profiled window's sync log (CUDA's sync debug mode "warn" on a GPU) counts each
    synchronisation warning by the Python lines that made it; other warnings pass through."""
    import warnings

    from lmms_train._profile import SyncLog

    def culprit():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    with warnings.catch_warnings(record=True) as passed:
        warnings.simplefilter("always")
        with SyncLog() as log:
            for _ in range(2):
                culprit()
            warnings.warn("unrelated", stacklevel=1)
    ((site, n),) = [(s["site"], s["count"]) for s in log.summary()]
    assert n == 2 and "culprit" in site[0], site
    assert [str(w.message) for w in passed] == ["unrelated"]


def test_sync_log_marks_syncs_replayed_from_backward():
    """Warnings raised in autograd's backward are replayed at the `backward()` call: the site
    says so."""
    import warnings

    from lmms_train._profile import SyncLog

    class Warns(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
            return g * 2

    x = torch.ones(3, requires_grad=True)
    with SyncLog() as log:
        Warns.apply(x).sum().backward()
    ((site, n),) = [(s["site"], s["count"]) for s in log.summary()]
    assert n == 1 and site[0] == "[backward]", site


def test_waits_after_the_window_closed_are_not_counted():
    from torch.profiler import ProfilerActivity, profile

    from lmms_train._profile import _CLOSE_MARK, summarize_waits

    x = torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x.sum().item()
        with torch.profiler.record_function(_CLOSE_MARK):
            x.sum().item()
        x.sum().item()
    summary = summarize_waits(prof.events(), kinds={"aten::_local_scalar_dense": "read"})
    assert summary["totals"]["read"]["count"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("loss_backend", ["auto", "torch", "liger"])
def test_steady_state_step_never_waits_for_the_device(
    tiny_inputs, tmp_path, no_torchrun, loss_backend
):
    """Issue 8's "no host synchronisation the profiler can point to", on the GPU: profile step 3
    of a tiny Qwen2.5-VL run (host grids, media placed from the host, sync-free loss) and
    require no stream/device sync at all, and none reported by CUDA's sync debug mode (which
    names the line). The loop's own event waits are at most two per profiled step, both on the
    previous step's events (its metrics copy and its end-of-step clock event). With
    `loss_backend: liger` the only syncs allowed are Liger's three (forward `.item()`, backward
    `torch.equal` on a fresh device tensor); `auto` (the Triton kernel) and `torch` have none."""
    import json

    if loss_backend == "liger" and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel not installed")
    cfg = tiny_config(tiny_inputs, tmp_path / "run", max_steps=4, save_final=False,
                      device="cuda", bf16=True, profile_steps=[3, 3],
                      loss_backend=loss_backend)  # fmt: skip
    train(config_from_dict(cfg))
    summary = json.loads((tmp_path / "run" / "profile" / "syncs_rank0.json").read_text())
    report = json.dumps({k: summary[k] for k in ("totals", "sites", "debug_sites")}, indent=1)
    assert summary["totals"]["event_wait"]["count"] <= 2, report
    liger = loss_backend == "liger"
    allowed = 3 if liger else 0
    assert summary["totals"]["sync"]["count"] <= allowed, report
    unknown = [
        s for s in summary["debug_sites"]
        if not (liger and any("ops/fused_linear_cross_entropy.py" in f for f in s["site"]))
    ]  # fmt: skip
    assert not unknown, report


def _tiny_master_pair(defer: bool):
    from lmms_optim import MasterAdamW
    from lmms_parallel import MasterWeights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    mw = MasterWeights(model)
    if defer:
        opt = MasterAdamW(list(mw.parameters()), lr=1e-2, backend="torch")
        mw.attach(opt, defer_cast=True)
    else:
        opt = torch.optim.AdamW(list(mw.parameters()), lr=1e-2)
        mw.attach(opt)
    return model, mw, opt


def test_deferred_cast_keeps_one_micro_batch_in_bf16_and_accumulates_more_in_fp32():
    """MasterWeights with `defer_cast` (the fused step's source of gradients): one micro-batch
    leaves each gradient bf16 (no fp32 copy), a second casts and accumulates in fp32 exactly as
    the default hook does, and the step then matches the default path bit for bit."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    runs = {d: _tiny_master_pair(d) for d in (False, True)}
    for micro in (1, 2):  # a step of one micro-batch, then a step of two
        for defer, (model, mw, _) in runs.items():
            for i in range(micro):
                model(x[i].bfloat16()).float().square().mean().backward()
                if defer and micro == 1:
                    m = next(mw.parameters())
                    assert m.grad is None and mw.gradient(m).dtype == torch.bfloat16
        (_, mw0, opt0), (_, mw1, opt1) = runs[False], runs[True]
        for a, b in zip(mw0.parameters(), mw1.parameters(), strict=True):
            torch.testing.assert_close(mw1.gradient(b).float(), a.grad, rtol=0, atol=0)
        norm = opt1.clip_norm_(0.0)  # measured, not clipped
        want = torch.nn.utils.get_total_norm([a.grad for a in mw0.parameters()])
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        for opt in (opt0, opt1):
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert not mw1._pending
        for (_, a), (_, b) in zip(
            runs[False][0].named_parameters(), runs[True][0].named_parameters(), strict=True
        ):
            assert torch.equal(a, b)  # the bf16 compute weights after the step
