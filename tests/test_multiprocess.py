"""2-process FSDP2 and Ulysses SP runs (gloo, CPU) equal the 1-process run over the first steps.

Same packs in every layout: lmms_data assigns data by slot = dp_rank * workers + worker and a
loader hands out batches round-robin over its workers, so one process with 2 workers and 2
micro-batches per step sees exactly the packs of 2 DP ranks with 0 workers and 1 micro-batch.
"""

from __future__ import annotations

import pytest
from e2e_helpers import run_cli, tiny_config, write_config

from lmms_train._metrics import read_jsonl

STEPS = 3


def _losses(out):
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]


@pytest.mark.multiprocess
def test_fsdp_and_sp_match_single_process(tiny_inputs, tmp_path):
    ref = tiny_config(
        tiny_inputs,
        tmp_path / "ref",
        max_steps=STEPS,
        gradient_accumulation_steps=2,
        save_final=False,
    )
    ref["dataset_config"]["num_workers"] = 2
    cfg = write_config(ref, tmp_path / "ref.yaml")
    proc = run_cli([str(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _losses(tmp_path / "ref")
    assert len(expected) == STEPS

    fsdp = run_cli([str(cfg), f"trainer_args.output_dir={tmp_path / 'fsdp'}", "trainer_args.gradient_accumulation_steps=1",
                    "dataset_config.num_workers=0"], nproc=2)  # fmt: skip
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert _losses(tmp_path / "fsdp") == pytest.approx(expected, rel=2e-5, abs=1e-6)
    # the patch embedding as one GEMM reads the root unit's gathered Conv3d weight directly
    linear = run_cli([str(cfg), f"trainer_args.output_dir={tmp_path / 'linear'}",
                      "trainer_args.gradient_accumulation_steps=1", "dataset_config.num_workers=0",
                      "trainer_args.linear_patch_embed=true"], nproc=2)  # fmt: skip
    assert linear.returncode == 0, linear.stderr[-3000:]
    assert _losses(tmp_path / "linear") == pytest.approx(_losses(tmp_path / "fsdp"), rel=1e-4)

    sp = run_cli(
        [
            str(cfg),
            f"trainer_args.output_dir={tmp_path / 'sp'}",
            "trainer_args.sp_ulysses_degree=2",
        ],
        nproc=2,
    )
    assert sp.returncode == 0, sp.stderr[-3000:]
    assert _losses(tmp_path / "sp") == pytest.approx(expected, rel=2e-5, abs=1e-6)
