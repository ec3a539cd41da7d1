"""Audio families through the trainer on 2 CPU ranks (gloo): FSDP2 and Ulysses SP equal the
1-process run. Qwen2-Audio and Aero: one rank's data all text next to a rank with audio (the audio tower's
dummy input keeps FSDP's collectives in step: no hang, same losses). Qwen2.5-Omni: one rank with
audio only next to one with images only (each runs the tower it lacks on a dummy input, in the
same order). Qwen3-Omni-MoE: the same, with deepstack and routed experts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from e2e_helpers import REPO, run_cli, write_config

from lmms_train._metrics import read_jsonl

STEPS = 3


@pytest.fixture(scope="module", params=["qwen2_audio", "qwen2_5_omni", "aero", "qwen3_omni_moe"])
def audio_inputs(request, tmp_path_factory) -> dict[str, str]:
    """Two shards, one unit each: audio records, then text-only (Qwen2-Audio) or image records
    (Qwen2.5-Omni): with 2 slots, slot 1 gets no audio."""
    pytest.importorskip("soundfile")
    pytest.importorskip("soxr")
    import lmms_data as ld

    family = request.param
    root = tmp_path_factory.mktemp(f"inputs_{family}")
    data = root / "data"
    data.mkdir()
    (a,) = ld.generate_synthetic_audio(str(root / "a"), 40, seed=0)
    if family in ("qwen2_audio", "aero"):
        (b,) = ld.generate_synthetic_text(str(root / "b"), 40, seed=0)
    else:
        (b,) = ld.generate_synthetic_vl(str(root / "b"), 40, seed=0)
    shutil.move(a, data / "shard-00000.parquet")
    shutil.move(b, data / "shard-00001.parquet")
    ld.build_local_processor(str(root / "processor"), "qwen2_audio" if family == "aero" else family)
    return {"family": family, "data": str(data), "processor": str(root / "processor")}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]


@pytest.mark.multiprocess
def test_audio_fsdp_and_sp_match_single_process(audio_inputs, tmp_path):
    example = REPO / "examples" / audio_inputs["family"] / "tiny_cpu.yaml"
    cfg = yaml.safe_load(example.read_text())
    cfg["model_config"]["processor_path"] = audio_inputs["processor"]
    if audio_inputs["family"] == "qwen3_omni_moe":  # LM loss only: under SP the aux loss is
        # per slice by design (tests/test_moe_aux.py), not SP 1's
        cfg["model_config"]["load_from_config"]["config"]["text_config"]["output_router_logits"] = (
            False
        )
    d = cfg["dataset_config"]
    d.pop("generate_synthetic")
    d.update(dataset_path=audio_inputs["data"], packing_length=384, shuffle=False, num_workers=2)
    t = cfg["trainer_args"]
    t.update(output_dir=str(tmp_path / "ref"), max_steps=STEPS, gradient_accumulation_steps=2,
             save_steps=0, save_final=False, eval_steps=0, report_to=[])  # fmt: skip
    path = write_config(cfg, tmp_path / "ref.yaml")
    ref = run_cli([str(path)])
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = _losses(tmp_path / "ref")
    rows = read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert len(expected) == STEPS and all(r["mfu"] > r["mfu_lm"] for r in rows)  # tower counted

    fsdp = run_cli([str(path), f"trainer_args.output_dir={tmp_path / 'fsdp'}",
                    "trainer_args.gradient_accumulation_steps=1", "dataset_config.num_workers=0"],
                   nproc=2)  # fmt: skip
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert _losses(tmp_path / "fsdp") == pytest.approx(expected, rel=2e-5, abs=1e-6)

    sp = run_cli([str(path), f"trainer_args.output_dir={tmp_path / 'sp'}",
                  "trainer_args.sp_ulysses_degree=2"], nproc=2)  # fmt: skip
    assert sp.returncode == 0, sp.stderr[-3000:]
    assert _losses(tmp_path / "sp") == pytest.approx(expected, rel=2e-5, abs=1e-6)
