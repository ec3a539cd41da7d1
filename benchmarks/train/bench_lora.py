"""LoRA and QLoRA speed and memory through `lmms-train` on one GPU, with full fine-tuning measured
alongside in the same call (issue 41 point 6).

Cases (bench_train's synthetic VL records and config builder: one image per sample, 224-672 px,
long-tailed text, packs of 16,384 tokens, Liger, bf16 compute, random weights of the published
shapes):

* ``vl3b_full_16k``: Qwen2.5-VL-3B, every parameter trained, every decoder and vision block
  checkpointed, bf16 AdamW moments (bench_train's 7B layout: it fits 80 GB uncompiled with room;
  issue 38's ``memory: auto`` H100 row, 74 GiB compiled, leaves too little for an uncompiled
  run) — the baseline;
* ``vl7b_lora_16k``: the Qwen2.5-VL-7B text shape over the same vision tower, LoRA rank 16 on
  every decoder linear, vision tower frozen, every decoder block checkpointed
  (examples/lora_dpo/qwen2_5_vl_7b_lora_16k.yaml);
* ``vl7b_qlora_16k``: the same with the adapted base weights in 4-bit NF4 (torchao).

Each case runs the real trainer in a subprocess (this script with ``--run-one``), which records
the GPU memory of the model build (``build_peak_gib``: a one-process run builds the model in
fp32 on the GPU before casting or quantising the frozen base) and then resets the peak counter,
so each step's ``peak_memory_gb`` is the training peak. ``whole_run_peak_gib`` is the larger of
the two: what the trainer's own metrics say for the same run.

    python benchmarks/train/bench_lora.py                          # every case (GPU)
    python benchmarks/train/bench_lora.py --tiny --cases vl3b_full_16k vl7b_lora_16k   # CPU check

Prints one JSON line per case and a table; writes bench_lora.json to $OUT after every case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import bench_train  # beside this script
from bench_memory_plan import bench_args, src_paths  # beside this script
from bench_records import make_records, write_parquet  # beside this script

LORA = {"rank": 16, "alpha": 32, "target_modules": ["all-linear"],
        "towers": {"decoder": "lora", "vision": "frozen"}}  # fmt: skip
LORA_LAYOUT = {"activation_checkpointing": "full", "vision_activation_checkpointing": "none"}
CASES: dict[str, dict] = {
    "vl3b_full_16k": dict(family="qwen2_5_vl", preset="3b", T=16384, optimizer="adamw", data="vl",
                          layout=bench_train.VL_7B, trainer=bench_train.BF16_STATE),
    "vl7b_lora_16k": dict(family="qwen2_5_vl", preset="3b", config="vl7b", T=16384,
                          optimizer="adamw", data="vl", layout=LORA_LAYOUT,
                          trainer={"learning_rate": 2e-4}, lora=LORA),
    "vl7b_qlora_16k": dict(family="qwen2_5_vl", preset="3b", config="vl7b", T=16384,
                           optimizer="adamw", data="vl", layout=LORA_LAYOUT,
                           trainer={"learning_rate": 2e-4}, lora={**LORA, "quantize_base": "nf4"}),
}  # fmt: skip


def run_one(config: str, info_file: str) -> int:
    """The trainer in this process; the build's GPU peak recorded, then the counter reset."""
    import torch

    import lmms_train._trainer as trainer
    from lmms_train.cli import main

    build, info = trainer.build_model, {}

    def measured_build(*args, **kwargs):
        built = build(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            info["build_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            info["after_build_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        return built

    trainer.build_model = measured_build
    code = main([config])
    Path(info_file).write_text(json.dumps(info))
    return code


def run_case(name: str, case: dict, work: Path, cli: argparse.Namespace) -> dict:
    import yaml

    # bench_memory_plan's options builder: this case's steps, no --vl-* override
    opts = argparse.Namespace(**{**vars(cli), "vl_warmup": None, "vl_steps": None})
    args = bench_args({"steps": cli.steps, "warmup": cli.warmup}, opts)
    cfg = bench_train.lmms_config(name, case, work, args)
    cfg["trainer_args"].update(case.get("trainer", {}), overwrite_output_dir=True)  # reruns
    if "lora" in case:
        cfg["model_config"]["lora"] = case["lora"]
    path, info = work / f"{name}.yaml", work / f"{name}.build.json"
    path.write_text(yaml.safe_dump(cfg))
    info.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path[:1] + src_paths() + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--run-one", str(path), str(info)]
    code, _, stderr = bench_train._run_case(cmd, env, args)
    row: dict = {"case": name, "T": cfg["dataset_config"]["packing_length"]}
    if code != 0:
        bench_train._save_log(name, stderr)
        tail = (stderr or "").strip().splitlines()[-3:]
        return {**row, "status": "error" if code is not None else "timeout",
                "error": " | ".join(tail)[-400:]}  # fmt: skip
    rows = [
        json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "tokens" in r]
    timed = [r for r in steps if r["step"] > args.warmup]
    built = json.loads(info.read_text()) if info.exists() else {}
    train_peak = max(r.get("peak_memory_gb", 0.0) for r in steps)
    row |= {"status": "ok", **built, "train_peak_gib": round(train_peak, 2),
            "whole_run_peak_gib": round(max(train_peak, built.get("build_peak_gib", 0.0)), 2),
            "trainable": cfg["model_config"].get("lora", "every parameter")}  # fmt: skip
    if timed:
        s = bench_train.summarize(timed)
        row |= {k: s[k] for k in ("steps", "tok_s", "mfu", "mfu_lm", "step_s", "step_s_median")}
        row["loss_first_last"] = [round(steps[0]["loss"], 4), round(steps[-1]["loss"], 4)]
    return row


def _guarded(name: str, work: Path, cli: argparse.Namespace) -> dict:
    try:
        return run_case(name, CASES[name], work, cli)
    except Exception as exc:
        return {"case": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=6, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--records", type=int, default=800)
    p.add_argument("--work", default="/tmp/lmms-bench-lora")
    p.add_argument("--case-timeout", type=int, default=240)
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (plumbing check)")
    p.add_argument("--run-one", nargs=2, metavar=("CONFIG", "INFO"), help=argparse.SUPPRESS)
    cli = p.parse_args()
    if cli.run_one:
        sys.exit(run_one(*cli.run_one))
    work = Path(cli.work)
    target = work / "data_vl" / "train.parquet"
    if not target.exists():
        write_parquet(make_records(64 if cli.tiny else cli.records, 0, images=True, tiny=cli.tiny),
                      target)  # fmt: skip
    results: list[dict] = []
    for name in cli.cases:  # one case's failure is a row, the others still run
        results.append(_guarded(name, work, cli))
        print(json.dumps(results[-1]), flush=True)
        if os.environ.get("OUT"):  # after every case: a call cut short keeps what ran
            Path(os.environ["OUT"], "bench_lora.json").write_text(json.dumps(results, indent=1))
    cols = ["case", "status", "tok_s", "mfu", "step_s", "train_peak_gib", "build_peak_gib",
            "whole_run_peak_gib"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")


if __name__ == "__main__":
    main()
