"""Through the CLI on 2 CPU ranks (gloo), each family's layouts equal one process.

Every case trains a 1-process reference in this process (`lmms_train.cli.main`); then ONE
torchrun launch (`e2e_helpers.run_cli_batch`) trains every selected case's 2-rank layouts in
turn, in the same two worker processes, so torch, transformers and lmms are imported once.

Same packs in every layout: lmms_data assigns data by slot = dp_rank * workers + worker and a
loader hands out batches round-robin over its workers, so one process with 2 workers and 2
micro-batches per step sees exactly the packs of 2 DP ranks with 0 workers and 1 micro-batch
(FSDP2), and of one SP group reading with the reference's 2 workers (Ulysses SP 2).

* quickstart (Qwen2.5-VL): FSDP2, FSDP2 with the patch embedding as one GEMM, SP 2.
* audio families, FSDP2 and SP 2. Qwen2-Audio and Aero: one rank's data all text next to a rank
  with audio (the audio tower's dummy input keeps FSDP's collectives in step: no hang, same
  losses). Qwen2.5-Omni: one rank with audio only next to one with images only (each runs the
  tower it lacks on a dummy input, in the same order). Qwen3-Omni-MoE: the same, with deepstack
  and routed experts.
* llava_onevision, FSDP2 and SP 2: packs without media keep the tower's collectives in step (the
  projector and newline included: ``vision_participation_outputs``); the vision-FLOPs imbalance
  over the DP ranks is logged.
* masked_diffusion (the quickstart's decoder, packs with images) and llada (a LLaDA-layout
  folder; rank 0 reads the LLaDA names, renamed on the way to the shards), FSDP2 and SP 2: the
  losses and masked-token metrics.
* wan, FSDP2 with ``frozen_encoders: shard`` (umT5 sharded, encoding on the fly), batch 2 per
  rank against batch 4: the losses, and the export is Wan's diffusers layout with the 1-process
  run's trained and EMA weights and its frozen encoders whole; it loads strictly.
* bagel, FSDP2 (per MoT layer and ViT block, weights initialised on rank 0 and broadcast into the
  shards): the loss and both terms of the session's straight run (conftest ``bagel_straight``).
"""

from __future__ import annotations

import functools
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from e2e_helpers import (
    REPO,
    bagel_args,
    llada_config,
    losses,
    run_cli_batch,
    run_cli_sequence,
    step_rows,
    tiny_config,
    write_config,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1800)]

EXAMPLES = REPO / "examples"
FSDP = ["trainer_args.gradient_accumulation_steps=1", "dataset_config.num_workers=0"]
SP = ["trainer_args.sp_ulysses_degree=2"]
TOL = {"rel": 2e-5, "abs": 1e-6}
MD_KEYS = ("loss", "md/masked_loss", "md/masked_acc", "md/mask_ratio")
AUDIO = ["qwen2_audio", "qwen2_5_omni", "aero", "qwen3_omni_moe"]


@dataclass
class Case:
    dir: Path  # where the runs write (`ref/` and one folder per layout, unless their args say)
    ref: list[str] | None  # CLI args of the 1-process reference (None: a fixture trained it)
    runs: dict[str, list[str]]  # layout -> CLI args of its 2-rank run
    errors: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None


def _layouts(cfg: dict, tmp: Path, **layouts: list[str]) -> Case:
    """`cfg` (its output_dir `tmp/ref`) as the reference; each layout its overrides of it."""
    path = str(write_config(cfg, tmp / "ref.yaml"))
    runs = {n: [path, f"trainer_args.output_dir={tmp / n}", *a] for n, a in layouts.items()}
    return Case(tmp, [path], runs)


def _quickstart(tmp: Path, request) -> Case:
    ref = tiny_config(request.getfixturevalue("tiny_inputs"), tmp / "ref", max_steps=3,
                      gradient_accumulation_steps=2, save_final=False)  # fmt: skip
    ref["dataset_config"]["num_workers"] = 2
    linear = [*FSDP, "trainer_args.linear_patch_embed=true"]
    return _layouts(ref, tmp, fsdp=FSDP, linear=linear, sp=SP)


def _audio(family: str, tmp: Path, request) -> Case:
    """Two shards, one unit each: audio records, then text-only (Qwen2-Audio, Aero) or image
    records (the Omni families): with 2 slots, slot 1 gets no audio."""
    pytest.importorskip("soundfile")
    pytest.importorskip("soxr")
    import lmms_data as ld

    data = tmp / "data"
    data.mkdir()
    (a,) = ld.generate_synthetic_audio(str(tmp / "a"), 40, seed=0)
    if family in ("qwen2_audio", "aero"):
        (b,) = ld.generate_synthetic_text(str(tmp / "b"), 40, seed=0)
    else:
        (b,) = ld.generate_synthetic_vl(str(tmp / "b"), 40, seed=0)
    shutil.move(a, data / "shard-00000.parquet")
    shutil.move(b, data / "shard-00001.parquet")
    ld.build_local_processor(str(tmp / "processor"), "qwen2_audio" if family == "aero" else family)
    cfg = yaml.safe_load((EXAMPLES / family / "tiny_cpu.yaml").read_text())
    cfg["model_config"]["processor_path"] = str(tmp / "processor")
    if family == "qwen3_omni_moe":  # LM loss only: under SP the aux loss is per slice by design
        # (packages/lmms-models/tests/test_moe_aux.py), not SP 1's
        cfg["model_config"]["load_from_config"]["config"]["text_config"]["output_router_logits"] = (
            False
        )
    d = cfg["dataset_config"]
    d.pop("generate_synthetic")
    d.update(dataset_path=str(data), packing_length=384, shuffle=False, num_workers=2)
    cfg["trainer_args"].update(output_dir=str(tmp / "ref"), max_steps=3, save_steps=0,
                               gradient_accumulation_steps=2, save_final=False, eval_steps=0,
                               report_to=[])  # fmt: skip
    return _layouts(cfg, tmp, fsdp=FSDP, sp=SP)


def _llava(tmp: Path, request) -> Case:
    cfg = yaml.safe_load((EXAMPLES / "llava_onevision" / "tiny_cpu.yaml").read_text())
    cfg["model_config"]["processor_path"] = str(tmp / "processor")
    d = cfg["dataset_config"]
    d.update(dataset_path=str(tmp / "data"), packing_length=384, num_workers=2)
    d["generate_synthetic"] = {"num_samples": 64}
    cfg["trainer_args"].update(output_dir=str(tmp / "ref"), max_steps=2, save_steps=0,
                               gradient_accumulation_steps=2, eval_steps=0, report_to=[],
                               save_final=False)  # fmt: skip
    return _layouts(cfg, tmp, fsdp=FSDP, sp=SP)


def _masked_diffusion(tmp: Path, request) -> Case:
    ref = tiny_config(request.getfixturevalue("tiny_inputs"), tmp / "ref", max_steps=3,
                      gradient_accumulation_steps=2, save_final=False)  # fmt: skip
    ref["model_config"]["objective"] = "masked_diffusion"
    ref["model_config"]["objective_args"] = {"mask_token_id": 7, "eps": 0.05}  # <|audio_pad|>
    ref["dataset_config"]["num_workers"] = 2
    return _layouts(ref, tmp, fsdp=FSDP, sp=SP)


def _llada(tmp: Path, request) -> Case:
    # lr 1e-3: Adam's first update turns last-bit gradient differences of near-zero entries
    # into whole-lr steps; a smaller lr keeps step 2 within the tolerance of the other layouts
    ref = llada_config(request.getfixturevalue("llada_inputs"), tmp / "ref", max_steps=2,
                       gradient_accumulation_steps=2, learning_rate=1e-3)  # fmt: skip
    ref["dataset_config"]["num_workers"] = 2
    return _layouts(ref, tmp, fsdp=FSDP, sp=SP)


def _wan(tmp: Path, request) -> Case:
    pytest.importorskip("diffusers")
    args = [str(EXAMPLES / "wan" / "tiny_cpu.yaml"), "trainer_args.max_steps=2",
            "trainer_args.ema_decay=0.5", "trainer_args.save_steps=0", "trainer_args.report_to=[]",
            "trainer_args.eval_steps=0", f"dataset_config.dataset_path={tmp / 'data'}",
            "dataset_config.generate_synthetic.num_samples=32",
            f"model_config.processor_path={tmp / 'processor'}"]  # fmt: skip
    one = [*args, f"trainer_args.output_dir={tmp / 'one'}", "dataset_config.extra.batch_size=4"]
    two = [*args, f"trainer_args.output_dir={tmp / 'two'}", "dataset_config.extra.batch_size=2",
           "trainer_args.fsdp=true", "trainer_args.frozen_encoders=shard"]  # fmt: skip
    return Case(tmp, one, {"two": two})


def _bagel(tmp: Path, request) -> Case:
    pytest.importorskip("diffusers")
    straight = request.getfixturevalue("bagel_straight")
    fsdp = bagel_args(straight, "fsdp", "trainer_args.max_steps=2", "trainer_args.save_steps=0",
                      "trainer_args.export_hf=false", "trainer_args.fsdp=true",
                      "dataset_config.num_workers=0")  # fmt: skip
    return Case(straight, None, {"fsdp": [str(EXAMPLES / "bagel" / "tiny_cpu.yaml"), *fsdp]})


CASES = {
    "quickstart": _quickstart,
    **{family: functools.partial(_audio, family) for family in AUDIO},
    "llava_onevision": _llava,
    "masked_diffusion": _masked_diffusion,
    "llada": _llada,
    "wan": _wan,
    "bagel": _bagel,
}


def _selected(request) -> list[str]:
    """The cases this session's tests of this module ask for (``-k`` may select fewer)."""
    ours = [item for item in request.session.items if item.path == request.path]
    asked = {getattr(item, "callspec", None) and item.callspec.params.get("case") for item in ours}
    return [c for c in CASES if c in asked]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict[str, Case]:
    """Each selected case's 1-process references (one fresh process for all of them: run in the
    test process they picked up state from earlier tests and gave other losses), then all
    their 2-rank runs in one torchrun launch."""
    cases: dict[str, Case] = {}
    for name in _selected(request):
        tmp = tmp_path_factory.mktemp(name)
        try:
            cases[name] = CASES[name](tmp, request)
        except pytest.skip.Exception as exc:
            cases[name] = Case(tmp, None, {}, skipped=str(exc))
        except Exception:
            cases[name] = Case(tmp, None, {}, errors={"ref": traceback.format_exc()})
    refs = {n: c.ref for n, c in cases.items() if c.ref is not None and not c.errors}
    for name, code in (run_cli_sequence(refs) if refs else {}).items():
        if code != 0:
            cases[name].errors["ref"] = f"the 1-process reference exited {code}"
    runs = {f"{n}/{layout}": args for n, c in cases.items() if not c.errors
            for layout, args in c.runs.items()}  # fmt: skip
    for key, error in run_cli_batch(runs, nproc=2).items():
        name, layout = key.split("/")
        if error is not None:
            cases[name].errors[layout] = error[-3000:]
    return cases


def _ran(launched: dict[str, Case], case: str) -> Path:
    """The case's folder, once every run of it finished (else its errors fail the test)."""
    c = launched[case]
    if c.skipped:
        pytest.skip(c.skipped)
    assert not c.errors, "\n".join(f"{layout}: {e}" for layout, e in c.errors.items())
    return c.dir


def _rows_close(got: list[dict], expected: list[dict], label: str) -> None:
    for r, e in zip(got, expected, strict=True):
        for k in e:
            assert r[k] == pytest.approx(e[k], **TOL), (label, k, r, e)


@pytest.mark.parametrize("case", ["quickstart"])
def test_quickstart_fsdp_linear_embed_and_sp(launched, case):
    out = _ran(launched, case)
    expected = losses(out / "ref")
    assert len(expected) == 3
    assert losses(out / "fsdp") == pytest.approx(expected, **TOL)
    # the patch embedding as one GEMM reads the root unit's gathered Conv3d weight directly
    assert losses(out / "linear") == pytest.approx(losses(out / "fsdp"), rel=1e-4)
    assert losses(out / "sp") == pytest.approx(expected, **TOL)


@pytest.mark.parametrize("case", AUDIO)
def test_audio_fsdp_and_sp(launched, case):
    out = _ran(launched, case)
    rows = step_rows(out / "ref")
    assert len(rows) == 3 and all(r["mfu"] > r["mfu_lm"] for r in rows)  # tower counted
    for layout in ("fsdp", "sp"):
        assert losses(out / layout) == pytest.approx([r["loss"] for r in rows], **TOL), layout


@pytest.mark.parametrize("case", ["llava_onevision"])
def test_llava_onevision_fsdp_and_sp(launched, case):
    out = _ran(launched, case)
    expected = losses(out / "ref")
    assert len(expected) == 2
    for layout in ("fsdp", "sp"):
        assert losses(out / layout) == pytest.approx(expected, **TOL), layout
        imbalance = [r["perf/vision_flops_imbalance"] for r in step_rows(out / layout)]
        assert all(x >= 1.0 for x in imbalance), imbalance  # max / mean over the DP ranks
        if layout == "sp":  # one DP rank: nothing to balance
            assert imbalance == [1.0] * len(expected)


@pytest.mark.parametrize("case", ["masked_diffusion", "llada"])
def test_masked_diffusion_fsdp_and_sp(launched, case):
    out = _ran(launched, case)
    expected = step_rows(out / "ref", *MD_KEYS)
    assert len(expected) == (3 if case == "masked_diffusion" else 2)
    assert all(r["md/mask_ratio"] > 0 for r in expected)
    for layout in ("fsdp", "sp"):
        _rows_close(step_rows(out / layout, *MD_KEYS), expected, layout)


@pytest.mark.parametrize("case", ["wan"])
def test_wan_fsdp_sharded_text_encoder_trains_and_exports(launched, case):
    import torch
    from safetensors.torch import load_file

    from lmms_models import get_model_spec

    out = _ran(launched, case)
    want = {r["step"]: r["loss"] for r in step_rows(out / "one")}  # same global batch of 4
    got = {r["step"]: r["loss"] for r in step_rows(out / "two")}
    assert len(want) == 2 and got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], rel=1e-5) for k in want), (got, want)
    for part in ("text_encoder", "vae"):
        (a,) = sorted((out / "one" / "hf" / part).glob("*.safetensors"))
        (b,) = sorted((out / "two" / "hf" / part).glob("*.safetensors"))
        wa, wb = load_file(str(a)), load_file(str(b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), part
    weights = "diffusion_pytorch_model.safetensors"
    one, two = (load_file(str(out / n / "hf" / weights)) for n in ("one", "two"))
    assert one.keys() == two.keys()
    assert all(one[k].shape == two[k].shape for k in one)
    for k in one:  # the exported trained weights are the 1-process run's
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6)
    get_model_spec("wan").build(pretrained=str(out / "two" / "hf"))  # strict, encoders attached
    # EMA (optimizer state, so FSDP2-sharded on 2 ranks) exported whole: the 1-process EMA, and
    # not the trained weights (decay 0.5 over 2 steps keeps a share of the initial weights)
    ema = {n: load_file(str(out / n / "hf_ema" / weights)) for n in ("one", "two")}
    assert ema["one"].keys() == one.keys() == ema["two"].keys()
    for k in one:
        torch.testing.assert_close(ema["two"][k], ema["one"][k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(ema["one"][k], one[k]) for k in one)


@pytest.mark.parametrize("case", ["bagel"])
def test_bagel_fsdp_equals_one_process(launched, case):
    out = _ran(launched, case)
    want = {r["step"]: r for r in step_rows(out / "straight")}
    got = {r["step"]: r for r in step_rows(out / "fsdp")}
    for step in (1, 2):
        for key in ("loss", "ce", "fm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=2e-5), (step, key)
