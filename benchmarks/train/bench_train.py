"""End-to-end training speed of `lmms-train` on one GPU, with plain transformers measured alongside.

Each lmms case writes a YAML config and runs the real CLI (`python -m lmms_train CONFIG`) in a
subprocess on a synthetic dataset (`bench_records.py`): Qwen2.5-VL-3B-shaped model (random weights),
one image per sample with sides drawn from 224–672 px, long-tailed text (lognormal, median ~250
tokens, cap 4096), the mix the calibration scripts in ../shared/calibration use. Numbers come from
the run's own `metrics.jsonl` (steps after `--warmup`): tokens/s, total and LM-only MFU against
989 TFLOP/s, peak memory, data-wait fraction and the forward/backward/optimizer split.

The baseline is upstream transformers on the *same records* processed by the same processor:
padded batches (each holding the samples that fill about one pack; `--hf-micro-tokens` cuts them
into micro-batches with gradient accumulation, as it would need to fit), sdpa attention, fp32 master
weights with bf16 autocast, gradient checkpointing, fused AdamW; with and without Liger's own
`apply_liger_kernel_to_qwen2_5_vl` (which includes its fused linear cross-entropy).

    python benchmarks/train/bench_train.py                      # every case (GPU, ~8 min)
    python benchmarks/train/bench_train.py --cases vl3b_16k hf_sdpa_liger
    python benchmarks/train/bench_train.py --tiny               # plumbing check on CPU

Each case has an activation-checkpointing layout (`CASES[...]["layout"]`, trainer_args keys): the
fastest bench_packed measured to fit one H200 for the VL cases, and no checkpointing for the
text cases; `--ac/--ac-fraction/--vision-ac/--vision-ac-fraction` override it for every case
(each row names the layout it ran with). Prints one JSON line per case and a table last;
writes bench_train.json to $OUT if set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trace_gaps  # beside this script
from bench_baseline import run_baseline  # beside this script
from bench_records import make_records, write_parquet  # beside this script

ROOT = Path(__file__).resolve().parents[2]
PEAK = 989e12  # H100/H200 dense bf16 datasheet, as peers report MFU

# Activation-checkpointing layouts per case: the fastest measured (or, where marked, predicted) to
# fit one H200 (141 GB) with fp32 master weights and AdamW state. Keys are trainer_args names.
# VL 16k and 32k: bench_packed (benchmarks/RESULTS.md, benchmarks/models/NOTES.md levers 3 and 9).
# VL 16k: half the decoder blocks checkpointed, the vision tower not (110.4 GiB compiled,
# 2026-12-03). A quarter is not settled (its one run timed out compiling, cold cache).
VL_16K = dict(activation_checkpointing="full", activation_checkpointing_fraction=0.5,
              vision_activation_checkpointing="none")  # fmt: skip
VL_32K = dict(activation_checkpointing="full", activation_checkpointing_fraction=1.0,
              vision_activation_checkpointing="full", vision_activation_checkpointing_fraction=0.5)  # fmt: skip
# Text 16k: no checkpointing. Predicted, not yet measured: 3B peaked at 64.6 GiB with half the
# blocks checkpointed, each un-checkpointed block adds ~1.45 GiB at 16k, so ~91 GiB for none.
TEXT_16K = dict(activation_checkpointing="none")
# VL-7B full fine-tuning (issue 29): every decoder and vision block checkpointed; the bf16-moment
# AdamW state makes it fit (benchmarks/optim/memory_fit.py: 109 GiB predicted with bf16 moments,
# 140 GiB with fp32 state, over the card)
VL_7B = dict(activation_checkpointing="full", vision_activation_checkpointing="full")
BF16_STATE = {"optimizer_state_dtype": "bfloat16"}

# name -> family, preset, packing_length, optimizer, data kind, AC layout
CASES: dict[str, dict] = {
    "vl3b_16k": dict(family="qwen2_5_vl", preset="3b", T=16384, optimizer="adamw", data="vl", layout=VL_16K),
    "vl3b_32k": dict(family="qwen2_5_vl", preset="3b", T=32768, optimizer="adamw", data="vl", layout=VL_32K),
    "vl3b_16k_muon": dict(family="qwen2_5_vl", preset="3b", T=16384, optimizer="muon", data="vl", layout=VL_16K),
    "vl3b_32k_muon": dict(family="qwen2_5_vl", preset="3b", T=32768, optimizer="muon", data="vl", layout=VL_32K),
    "text3b_16k": dict(family="qwen2_5", preset="3b", T=16384, optimizer="adamw", data="text", layout=TEXT_16K),
    "text1p5b_16k": dict(family="qwen2_5", preset="1.5b", T=16384, optimizer="adamw", data="text", layout=TEXT_16K),
    # Qwen3-1.7B shape, causal LM against masked diffusion (bidirectional), AdamW and Muon
    "qwen3_1p7b_16k": dict(family="qwen3", config="qwen3_1p7b", T=16384, optimizer="adamw", data="text", layout=TEXT_16K),
    "qwen3_1p7b_16k_md": dict(family="qwen3", config="qwen3_1p7b", T=16384, optimizer="adamw", data="text", layout=TEXT_16K, objective="masked_diffusion"),
    "qwen3_1p7b_16k_muon": dict(family="qwen3", config="qwen3_1p7b", T=16384, optimizer="muon", data="text", layout=TEXT_16K),
    "qwen3_1p7b_16k_md_muon": dict(family="qwen3", config="qwen3_1p7b", T=16384, optimizer="muon", data="text", layout=TEXT_16K, objective="masked_diffusion"),
    # Qwen2.5-VL-7B shape, every parameter trained: bf16 moments (fits), fp32 state (its baseline)
    "vl7b_16k": dict(family="qwen2_5_vl", preset="3b", config="vl7b", T=16384, optimizer="adamw", data="vl", layout=VL_7B, trainer=BF16_STATE),
    "vl7b_16k_fp32state": dict(family="qwen2_5_vl", preset="3b", config="vl7b", T=16384, optimizer="adamw", data="vl", layout=VL_7B),
    "hf_sdpa": dict(baseline=True, liger=False, T=16384),
    "hf_sdpa_liger": dict(baseline=True, liger=True, T=16384),
}  # fmt: skip
# Model shapes given as HF config keys (families without a preset of that size)
CONFIGS = {
    "qwen3_1p7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # published Qwen2.5-VL-7B-Instruct text shape over the 3B preset (same vision tower)
    "vl7b": {"text_config": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, tie_word_embeddings=False),
             "vision_config": {"out_hidden_size": 3584}, "tie_word_embeddings": False},
}  # fmt: skip
# masked diffusion's mask token in the benchmark's local tokenizer: <|audio_pad|>, never in text
MD_ARGS = {"mask_token_id": 7}
# CLI flag -> trainer_args key; a flag given on the command line overrides every case's layout
AC_FLAGS = {
    "ac": "activation_checkpointing",
    "ac_fraction": "activation_checkpointing_fraction",
    "vision_ac": "vision_activation_checkpointing",
    "vision_ac_fraction": "vision_activation_checkpointing_fraction",
}


def ac_layout(case: dict, args) -> dict:
    """The case's AC layout with the command line's explicit flags on top."""
    layout = dict(case.get("layout", {}))
    layout |= {
        key: getattr(args, flag)
        for flag, key in AC_FLAGS.items()
        if getattr(args, flag) is not None
    }
    return layout


def lmms_config(name: str, case: dict, work: Path, args) -> dict:
    family = "qwen2_5_vl" if case["data"] == "vl" else "qwen2_5"
    load = {"model_type": case["family"]}
    if args.tiny:
        load["tiny"] = True
        if case["data"] == "vl":
            load["config"] = {"vision_config": {"patch_size": 14, "window_size": 112}}
    else:
        if case.get("preset"):
            load["preset"] = case["preset"]
        if case.get("config"):  # on top of the preset, if any
            load["config"] = CONFIGS[case["config"]]
    T = 1024 if args.tiny else case["T"]
    objective = case.get("objective", "causal_lm")
    return {
        "model_config": {
            "load_from_config": load,
            "processor_path": str(work / f"processor_{family}"),
            "build_local_processor": True,
            "objective": objective,
            "objective_args": MD_ARGS if objective == "masked_diffusion" else {},
        },
        "dataset_config": {
            "dataset_path": str(work / f"data_{case['data']}" / "train.parquet"),
            "packing": True,
            "packing_strategy": "first_fit",
            "packing_length": T,
            "max_open_bins": 16,
            "num_workers": 0 if args.tiny else 10,
            "min_pixels": 56 * 56 if args.tiny else 224 * 224,
            "max_pixels": 84 * 84 if args.tiny else 672 * 672,
        },
        "trainer_args": {
            "output_dir": str(work / "runs" / name),
            "max_steps": args.warmup + args.steps,
            "learning_rate": 1e-5,
            "optimizer": case["optimizer"],
            "bf16": not args.tiny,
            "use_rmpad": True,
            "use_liger_kernel": not args.tiny,
            "attn_backend": "auto",
            "vision_attn_backend": args.vision_attn,
            "linear_patch_embed": args.linear_patch_embed,
            **(
                {}
                if args.fused_master_step is None
                else {"fused_master_step": args.fused_master_step}
            ),
            **({} if args.muon_fused_step is None else {"muon_fused_step": args.muon_fused_step}),
            **ac_layout(case, args),
            "reshard_after_forward": not args.keep,
            "fsdp": True if args.fsdp else None,  # None: FSDP2 only on several processes
            "gradient_accumulation_steps": args.ga,
            "save_final": False,
            "report_to": [],
            "profile_step_breakdown": True,
            "compile": args.compile,
            "loss_backend": args.loss_backend,
            "profile_steps": args.profile_steps or [],
            "seed": 0,
            **LEVERS_OFF,  # each lever off unless asked: rows before/after in the same run
            **case.get("trainer", {}),
            **lever_args(args),
        },
    }


# Issue 29's levers, off in every row unless its flag is given (the trainer's own defaults may
# differ): a row says what it ran with (`levers`), and a lever's before/after is two rows
LEVERS_OFF = {"loss_rows": "all", "gc_control": False, "compile_warmup": False}


def lever_args(args) -> dict:
    """trainer_args of the levers asked for on the command line."""
    out: dict = {}
    if args.loss_rows:
        out["loss_rows"] = args.loss_rows
    if args.gc_control:
        out["gc_control"] = True
    if args.compile_warmup:
        out["compile_warmup"] = True
    if args.optimizer_state_dtype:
        out["optimizer_state_dtype"] = args.optimizer_state_dtype
    return out


def summarize(rows: list[dict]) -> dict:
    """The timed steps' figures: means over all of them (tokens/s, MFU and shares weighted by
    step time), and, when some step took over 3x the median, the same figures without those
    steps (`steady`) and each slow step's host GC time, dynamo graph count and FA4 kernel count
    (on a cold cache every VL run so far had one, always the same step: a full collection, a
    recompile and a new FA4 variant look the same in the step time)."""
    dt = sum(r["step_time"] for r in rows)

    def weighted(k: str, part: list[dict] = rows) -> float:
        return round(
            sum(r.get(k, 0.0) * r["step_time"] for r in part) / sum(r["step_time"] for r in part), 4
        )

    median = statistics.median(r["step_time"] for r in rows)
    slow = [r for r in rows if r["step_time"] > 3 * median]
    out = {
        "steps": len(rows),
        "tok_s": round(sum(r["tokens"] for r in rows) / dt),
        "mfu": weighted("mfu"),  # standard convention: causal attention counted whole
        "mfu_lm": weighted("mfu_lm"),
        "mfu_causal_half": weighted("mfu_causal_half"),  # causal attention counted at half
        **(
            {"mfu_all_rows": weighted("mfu_all_rows")}
            if all("mfu_all_rows" in r for r in rows)
            else {}
        ),
        "peak_gib": round(max(r.get("peak_memory_gb", 0.0) for r in rows), 1),
        "data_wait": weighted("data_wait_fraction"),  # exposed: the device may have idled
        "data_read": weighted("data_read_fraction"),  # all the host's time blocked on the loader
        "step_s": round(dt / len(rows), 3),
        "fill": round(sum(r["packing_fill_ratio"] for r in rows) / len(rows), 3),
        "step_s_each": [round(r["step_time"], 3) for r in rows],
        "step_s_median": round(median, 3),
        # a cold start's cost: the mean step over the median (1.0: no step out of line)
        "mean_over_median": round(dt / len(rows) / median, 4),
        "slow_steps": {
            r["step"]: {
                "s": round(r["step_time"], 3),
                "gc_s": round(r.get("perf/gc_s", 0.0), 3),
                "graphs": r.get("compile/graphs"),
                "fa4_variants": r.get("compile/fa4_variants"),
            }
            for r in slow
        },
        "gc_s_max": round(max(r.get("perf/gc_s", 0.0) for r in rows), 3),
        "gc_full": sum(r.get("perf/gc_full", 0.0) for r in rows),  # automatic full collections
        "new_graphs": sum(r.get("compile/new_graphs", 0) for r in rows),  # compiled in timed steps
        "graphs": sorted({r["compile/graphs"] for r in rows if "compile/graphs" in r}),
        "fa4_variants": sorted(
            {r["compile/fa4_variants"] for r in rows if "compile/fa4_variants" in r}
        ),
    }
    steady = [r for r in rows if r not in slow]
    if slow and steady:
        st = sum(r["step_time"] for r in steady)
        out["steady"] = {
            "steps": len(steady),
            "tok_s": round(sum(r["tokens"] for r in steady) / st),
            "mfu": weighted("mfu", steady),
            "mfu_lm": weighted("mfu_lm", steady),
            "mfu_causal_half": weighted("mfu_causal_half", steady),
            "step_s": round(st / len(steady), 3),
        }
    return out


def _save_log(name: str, text: str | bytes | None) -> None:
    """The end of a failed case's stderr, to $OUT/NAME.log (for the traceback)."""
    if os.environ.get("OUT") and text:
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        Path(os.environ["OUT"], f"{name}.log").write_text(text[-60000:])


def _run_case(cmd: list[str], env: dict, args) -> tuple[int | None, str, str]:
    """Run one case in its own process group; on timeout kill the whole group (loader and
    compile workers too) and wait for it, so the next case starts on a GPU with nothing left of
    this one. Returns (exit code or None on timeout, stdout, stderr)."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=args.case_timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def run_lmms(name: str, case: dict, work: Path, args) -> dict:
    import yaml

    cfg = lmms_config(name, case, work, args)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in sorted(ROOT.glob("packages/*/src"))]
        + [str(ROOT / "apps/trainer/src"), env.get("PYTHONPATH", "")]
    )
    if args.cold_cache:  # empty Inductor, Triton and FA4 disk caches: a first run on a machine
        cold = Path(tempfile.mkdtemp(prefix=f"cold-{name}-", dir=work))
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):  # fmt: skip
            env[var] = str(cold / var.lower())
    t0 = time.perf_counter()
    code, stdout, stderr = _run_case([sys.executable, "-m", "lmms_train", str(path)], env, args)
    wall = time.perf_counter() - t0
    if code is None:  # timed out: keep what it logged (where did the time go?)
        _save_log(name, stderr)
        return {
            "case": name,
            "status": "timeout",
            "error": f"over --case-timeout {args.case_timeout} s",
        }
    if code != 0:
        _save_log(name, stderr)
        tail = (stderr or stdout).strip().splitlines()[-3:]
        return {"case": name, "status": "error", "error": " | ".join(tail)[-300:]}
    rows = [
        json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    profiled = range(args.profile_steps[0], args.profile_steps[1] + 1) if args.profile_steps else ()
    # timed: step rows after warm-up, not profiled (the profiler slows the steps it records)
    rows = [r for r in rows if args.warmup < r.get("step", 0) not in profiled and "tokens" in r]
    out = {
        "case": name,
        "status": "ok",
        "T": cfg["dataset_config"]["packing_length"],
        **summarize(rows),
        "wall_s": round(wall, 1),
        "layout": " ".join(f"{k}={v}" for k, v in ac_layout(case, args).items()),
        "compile": args.compile,
        "loss_backend": args.loss_backend,
        "vision_attn": args.vision_attn or "auto",
        "linear_patch_embed": args.linear_patch_embed,
        "fused_master_step": "default"
        if args.fused_master_step is None
        else args.fused_master_step,
        "muon_fused_step": "default" if args.muon_fused_step is None else args.muon_fused_step,
        "ga": args.ga,
        "levers": " ".join(f"{k}={v}" for k, v in {**LEVERS_OFF, **lever_args(args)}.items()),
        "optimizer_state_dtype": cfg["trainer_args"].get("optimizer_state_dtype", "float32"),
        "cold_cache": args.cold_cache,
        # the trainer's own account of each stalled step (its likely cause; FA4's new key)
        "slow_step_lines": [ln for ln in stderr.splitlines() if "[lmms-train] slow step" in ln],
    }
    syncs = work / "runs" / name / "profile" / "syncs_rank0.json"
    if args.profile_steps and syncs.exists():  # where the host waited for the device
        ops = syncs.with_name("ops_rank0.txt")
        if os.environ.get("OUT") and ops.exists():  # operators, then where the device idled
            gaps = trace_gaps.format_report(
                trace_gaps.analyze(trace_gaps.load(ops.with_name("trace_rank0.json.gz")))
            )
            Path(os.environ["OUT"], f"{name}.ops.txt").write_text(ops.read_text() + "\n" + gaps)
        summary = json.loads(syncs.read_text())
        out["host_waits"] = summary["totals"]
        # CUDA's sync debug mode during the window: the Python lines that synchronised
        out["sync_sites"] = [
            f"{s['count']}x at {' <- '.join(s['site'][:3]) or '?'}"
            for s in summary.get("debug_sites", [])[:8]
        ]
    for part in ("forward", "backward", "optimizer"):
        key = f"time/{part}"
        if all(key in r for r in rows):
            out[key] = round(sum(r[key] for r in rows) / len(rows), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=20, help="measured steps per case")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--ac",
        choices=["none", "full", "selective"],
        help="trainer_args.activation_checkpointing for every case (default: each case's layout)",
    )
    p.add_argument(
        "--ac-fraction",
        type=float,
        help="trainer_args.activation_checkpointing_fraction: share of decoder blocks "
        "checkpointed, spread evenly (0.5 = every other block)",
    )
    p.add_argument(
        "--vision-ac",
        choices=["same", "none", "full", "selective"],
        help="trainer_args.vision_activation_checkpointing (same: --ac and --ac-fraction)",
    )
    p.add_argument(
        "--vision-ac-fraction",
        type=float,
        help="trainer_args.vision_activation_checkpointing_fraction (with --vision-ac full)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="trainer_args.reshard_after_forward: false (gathered weights kept until backward)",
    )
    p.add_argument("--compile", action="store_true", help="trainer_args.compile: blocks compiled")
    p.add_argument("--fsdp", action="store_true", help="trainer_args.fsdp: true (one-rank FSDP2)")
    p.add_argument("--ga", type=int, default=1, help="trainer_args.gradient_accumulation_steps")
    p.add_argument(
        "--loss-backend",
        default="auto",
        help="trainer_args.loss_backend: the fused linear cross-entropy (auto, liger, triton, torch)",
    )
    p.add_argument(
        "--fused-master-step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trainer_args.fused_master_step (clip, AdamW and bf16 write-back in one kernel); "
        "default: the trainer's (on); --no-fused-master-step for the three-pass step",
    )
    p.add_argument(
        "--muon-fused-step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trainer_args.muon_fused_step (lmms_optim.MasterMuon: Muon's memory-bound passes "
        "fused, bf16 gradients read as they are); default: the trainer's (on); "
        "--no-muon-fused-step for Muon + clip + copy",
    )
    p.add_argument(
        "--linear-patch-embed",
        action="store_true",
        help="trainer_args.linear_patch_embed: the vision patch embedding as one GEMM",
    )
    p.add_argument(
        "--vision-attn",
        default=None,
        help="trainer_args.vision_attn_backend: the vision tower's own varlen backend (e.g. torch)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        nargs=2,
        metavar=("FIRST", "LAST"),
        help="trainer_args.profile_steps: profile these steps (left out of the timed ones); rows "
        "get the host waits (count, ms, top call sites) from the run's profile/syncs_rank0.json",
    )
    p.add_argument(
        "--hf-micro-tokens",
        type=int,
        default=0,
        help="plain-transformers baselines: cut each step's padded batch into micro-batches of at "
        "most this many padded tokens (gradient accumulation; 0: one batch per step)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="appended to each case's run folder and row name and to bench_train.json "
        "(two invocations of one case with different flags, e.g. a lever's before and after)",
    )
    p.add_argument(
        "--loss-rows",
        choices=["all", "labelled"],
        help="trainer_args.loss_rows (default here: all): labelled = the LM head on labelled rows",
    )
    p.add_argument(
        "--gc-control",
        action="store_true",
        help="trainer_args.gc_control: true (freeze after step 1, no automatic collections)",
    )
    p.add_argument(
        "--compile-warmup",
        action="store_true",
        help="trainer_args.compile_warmup: true (with --compile: compile before step 1)",
    )
    p.add_argument(
        "--optimizer-state-dtype",
        choices=["float32", "bfloat16"],
        help="trainer_args.optimizer_state_dtype for every case (default: the case's)",
    )
    p.add_argument(
        "--cold-cache",
        action="store_true",
        help="each case with empty Inductor, Triton and FA4 disk caches (a cold start)",
    )
    p.add_argument(
        "--json", help="file name of the rows under $OUT (default bench_train<tag>.json)"
    )
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--work", default="/tmp/lmms-bench-train")
    p.add_argument("--case-timeout", type=int, default=400)
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (plumbing check)")
    args = p.parse_args()
    work = Path(args.work)
    kinds = {"vl" if CASES[c].get("baseline") else CASES[c]["data"] for c in args.cases}
    n = 64 if args.tiny else args.records
    for kind in sorted(kinds):
        target = work / f"data_{kind}" / "train.parquet"
        if not target.exists():
            write_parquet(make_records(n, 0, images=kind == "vl", tiny=args.tiny), target)
    results = []
    for name in args.cases:
        case = CASES[name]
        ids_file = work / "processor_qwen2_5_vl" / "lmms_token_ids.json"
        if case.get("baseline") and not ids_file.exists():
            from lmms_data import build_local_processor

            # Deterministic: the same folder the lmms runs build, plus its token ids.
            info = build_local_processor(str(ids_file.parent), "qwen2_5_vl")
            ids_file.write_text(json.dumps(info))
        try:
            run = run_baseline if case.get("baseline") else run_lmms
            res = run(name + args.tag, case, work, args)
        except Exception as exc:
            res = {
                "case": name + args.tag,
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}"[:300],
            }
        print(json.dumps(res), flush=True)
        results.append(res)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], args.json or f"bench_train{args.tag}.json").write_text(
            json.dumps(results, indent=1)
        )
    cols = ["case", "status", "T", "tok_s", "mfu", "mfu_causal_half", "mfu_lm", "peak_gib",
            "data_wait", "step_s", "step_s_median", "time/forward", "time/backward",
            "time/optimizer"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
        if "steady" in r:  # the same run without its slow steps
            st = {**r["steady"], "case": f"{r['case']} steady ({r['steady']['steps']} steps)"}
            print("| " + " | ".join(str(st.get(c, "")) for c in cols) + " |")
    base = {r["case"]: r for r in results if r["status"] == "ok"}
    for ref in ("hf_sdpa", "hf_sdpa_liger"):
        if ref in base and "vl3b_16k" in base:
            ratio = base["vl3b_16k"]["tok_s"] / base[ref]["tok_s"]
            print(f"vl3b_16k vs {ref}: {ratio:.1f}x tokens/s")
    if not math.isfinite(sum(r.get("tok_s", 0) for r in results)):
        sys.exit(1)


if __name__ == "__main__":
    main()
