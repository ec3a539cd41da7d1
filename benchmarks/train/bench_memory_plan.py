"""The memory plan against the measured peak, in the same run, for several families (issue 38).

Each case runs the real CLI (`python -m lmms_train CONFIG`, bench_train's synthetic records and
config) on the GPU. The prediction is the run's own: its preflight logs
`[lmms-train] memory plan: peak X GiB allocated` before the model is built (with `memory: auto`
after choosing the layout). The measured peak is `peak_memory_gb` of its metrics.jsonl
(`torch.cuda.max_memory_allocated` over the whole run, optimizer state included). The plan's one
data input, the share of media placeholder tokens in a pack, is read from the first records with
`lmms-train check-data`'s counter before the run (the largest per-step share seen in the run is
printed beside it).

    python benchmarks/train/bench_memory_plan.py                    # every case (GPU)
    python benchmarks/train/bench_memory_plan.py --cases text1p5b_16k qwen3_moe_16k
    python benchmarks/train/bench_memory_plan.py --tiny --cases text1p5b_16k   # plumbing, CPU

`vl3b_16k_h100` is issue 38's point 4: the Qwen2.5-VL-3B shape, every parameter trained, 16k
tokens per step, `memory: auto` on the card it finds, compiled, issue 29's levers on; its row
also gives tok/s, total MFU (bench_train's `summarize`) and the forward/backward/optimizer split.
`vl3b_16k_h100_13full` fixes the layout auto chose before selective checkpointing was among
its candidates. A before-row in the same call: `--src OTHER_CHECKOUT --tag _base` runs the
trainer from another tree (e.g. `git archive` of an earlier commit) with this script's configs:

    python benchmarks/train/bench_memory_plan.py --cases vl3b_16k_h100 --src /tmp/base --tag _base
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import bench_train  # beside this script
from bench_records import make_records, write_parquet  # beside this script

ROOT = Path(__file__).resolve().parents[2]

# Small shapes that run in seconds per step, one per family (HF config keys)
bench_train.CONFIGS.update(
    {
        "qwen3_moe_small": dict(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072,
            moe_intermediate_size=768, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
            norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        # Llama-3.2-1B's shape (tied embeddings, GQA 32/8, head dim 64)
        "llama3_1b": dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, use_cache=False,
        ),
    }
)  # fmt: skip
NO_AC = dict(activation_checkpointing="none")
HALF_AC = dict(activation_checkpointing="full", activation_checkpointing_fraction=0.5)
LEVERS_ON = dict(loss_rows="labelled", gc_control=True, compile_warmup=True)
CASES: dict[str, dict] = {
    "vl3b_16k_h100": dict(family="qwen2_5_vl", preset="3b", T=16384, optimizer="adamw", data="vl",
                          layout={}, compile=True, steps=12, warmup=3,
                          trainer={"memory": "auto", **LEVERS_ON}),
    "text1p5b_16k": dict(family="qwen2_5", preset="1.5b", T=16384, optimizer="adamw",
                         data="text", layout=NO_AC),
    "qwen3_1p7b_16k_halfac": dict(family="qwen3", config="qwen3_1p7b", T=16384, optimizer="adamw",
                                  data="text", layout=HALF_AC),
    "qwen3_moe_16k": dict(family="qwen3_moe", config="qwen3_moe_small", T=16384,
                          optimizer="adamw", data="text", layout=NO_AC),
    "llava_ov_0p5b_16k": dict(family="llava_onevision", preset="0.5b", T=16384, optimizer="adamw",
                              data="vl", layout=dict(activation_checkpointing="none")),
    "llama3_1b_16k": dict(family="llama", config="llama3_1b", T=16384, optimizer="adamw",
                          data="text", layout=NO_AC),
    # issue 38's point 4, timed beside the auto row: the layout `memory: auto` chose before
    # selective checkpointing was among its candidates (13 of 36 decoder blocks and every
    # vision block in full, bf16 moments): with the `_base` row (another checkout) it isolates
    # the optimizer step, with the auto row the layout
    "vl3b_16k_h100_13full": dict(family="qwen2_5_vl", preset="3b", T=16384, optimizer="adamw",
                                 data="vl", compile=True, steps=12, warmup=3,
                                 layout=dict(activation_checkpointing="full",
                                             activation_checkpointing_fraction=13 / 36 + 1e-9,
                                             vision_activation_checkpointing="full",
                                             vision_activation_checkpointing_fraction=1.0),
                                 trainer={"optimizer_state_dtype": "bfloat16", **LEVERS_ON}),
    # issue 38's point 4, second half: the Qwen2.5-VL-7B shape (bench_train's `vl7b`: the
    # published 7B text shape over the 3B vision tower), every parameter trained, 16k, on ONE
    # H200 with `memory: auto` (the plan's choice and its prediction against the peak)
    "vl7b_16k_h200": dict(family="qwen2_5_vl", preset="3b", config="vl7b", T=16384,
                          optimizer="adamw", data="vl", layout={}, compile=True, steps=6,
                          warmup=2, trainer={"memory": "auto", **LEVERS_ON}),
    "vl3b_8k_bf16state": dict(family="qwen2_5_vl", preset="3b", T=8192, optimizer="adamw",
                              data="vl", layout=HALF_AC,
                              trainer={"optimizer_state_dtype": "bfloat16"}),
}  # fmt: skip
# one per family, the GPU call's order (the 3B VL row first: issue 38's point 4)
DEFAULT = ["vl3b_16k_h100", "text1p5b_16k", "qwen3_moe_16k", "qwen3_1p7b_16k_halfac",
           "llava_ov_0p5b_16k", "llama3_1b_16k"]  # fmt: skip
PLAN_LINE = re.compile(r"\[lmms-train\] memory plan: peak ([0-9.]+) GiB allocated \(([^)]*)\)")
AUTO_LINE = re.compile(r"\[lmms-train\] memory: auto chose (.*)")


def bench_args(case: dict, cli: argparse.Namespace) -> argparse.Namespace:
    """bench_train's options for one case (its config builder reads them)."""
    timed = "warmup" in case  # the timed rows: --vl-steps / --vl-warmup override
    return argparse.Namespace(
        tiny=cli.tiny,
        warmup=(cli.vl_warmup or case["warmup"]) if timed else 1,
        steps=(cli.vl_steps or case["steps"]) if timed else cli.steps,
        vision_attn=None, linear_patch_embed=False, fused_master_step=None, muon_fused_step=None,
        keep=False, fsdp=False, ga=1, compile=bool(case.get("compile")) and not cli.tiny,
        loss_backend="auto", profile_steps=None, loss_rows=None, gc_control=False,
        compile_warmup=False, optimizer_state_dtype=None, ac=None, ac_fraction=None,
        vision_ac=None, vision_ac_fraction=None, case_timeout=cli.case_timeout, cold_cache=False,
    )  # fmt: skip


def processor_folder(family: str, work: Path, tiny: bool) -> str:
    """The local processor folder of a VL case. LLaVA-OneVision's default local processor is the
    tiny one (32 px views, 16 features: the tiny config's SigLIP); a preset's SigLIP takes 384 px
    views of 729 patches, so its folder is built here with the released checkpoints' settings
    (the trainer reuses an existing folder). Other families: the trainer builds the folder."""
    if family != "llava_onevision" or tiny:
        return str(work / f"processor_{family}")
    from lmms_data.processors._local_llava import RELEASED_LLAVA, build_local_llava_processor

    path = work / f"processor_{family}_{RELEASED_LLAVA['view']}"
    if not path.exists():
        build_local_llava_processor(str(path), settings=RELEASED_LLAVA)
    return str(path)


def media_share(cfg_path: Path) -> float:
    """Media placeholder tokens over all tokens of the first 300 records (check-data's count)."""
    from lmms_train._check_data import check_data
    from lmms_train.config import load_config

    report = check_data(load_config(str(cfg_path)), 300)
    return sum(report.media_tokens) / max(1, sum(report.lengths))


def run_case(name: str, case: dict, work: Path, cli: argparse.Namespace) -> dict:
    import yaml

    args = bench_args(case, cli)
    run = name + cli.tag  # its run folder and config file
    cfg = bench_train.lmms_config(run, case, work, args)
    if case["data"] == "vl":  # each family its own local processor folder
        cfg["model_config"]["processor_path"] = processor_folder(case["family"], work, cli.tiny)
    cfg["trainer_args"].update(case.get("trainer", {}))
    path = work / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    share = media_share(path) if case["data"] == "vl" else 0.0
    cfg["trainer_args"]["memory_media_share"] = round(share, 4)
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ)
    src = src_paths(Path(cli.src) if cli.src else ROOT)
    env["PYTHONPATH"] = os.pathsep.join(sys.path[:1] + src + [env.get("PYTHONPATH", "")])
    code, _, stderr = bench_train._run_case(
        [sys.executable, "-m", "lmms_train", str(path)], env, args
    )
    plan = PLAN_LINE.search(stderr or "")
    auto = AUTO_LINE.search(stderr or "")
    row = {"case": run, "family": case["family"], "src": cli.src or "this tree",
           "T": cfg["dataset_config"]["packing_length"],
           "media_share": round(share, 3), "auto": auto.group(1) if auto else None,
           "predicted_gib": float(plan.group(1)) if plan else None,
           "moment": plan.group(2) if plan else None}  # fmt: skip
    if code != 0:
        bench_train._save_log(run, stderr)
        tail = (stderr or "").strip().splitlines()[-3:]
        return {**row, "status": "error" if code is not None else "timeout",
                "error": " | ".join(tail)[-400:]}  # fmt: skip
    rows = [json.loads(x) for x in (work / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens" in r]
    timed = [r for r in steps if r["step"] > args.warmup]
    measured = max(r.get("peak_memory_gb", 0.0) for r in steps)
    shares = [r.get("vision_tokens", 0) / max(1, r["tokens"]) for r in steps]
    row |= {
        "status": "ok",
        "measured_gib": round(measured, 2),
        "max_step_share": round(max(shares), 3),
    }
    if row["predicted_gib"]:
        row["error_pct"] = round(100 * (row["predicted_gib"] - measured) / measured, 1)
    if timed:
        s = bench_train.summarize(timed)
        row |= {k: s[k] for k in ("steps", "tok_s", "mfu", "mfu_lm", "step_s", "step_s_median")}
        row["mfu_all_rows"] = s.get("mfu_all_rows")
        row["step_s_each"] = s["step_s_each"]
        for part in ("forward", "backward", "optimizer"):  # the step's split (means)
            key = f"time/{part}"
            if all(key in r for r in timed):
                row[key] = round(sum(r[key] for r in timed) / len(timed), 3)
    return row


def src_paths(root: Path = ROOT) -> list[str]:
    return [str(p) for p in sorted(root.glob("packages/*/src"))] + [str(root / "apps/trainer/src")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=DEFAULT, choices=list(CASES))
    p.add_argument("--steps", type=int, default=3, help="steps after the first (non-VL-3B cases)")
    p.add_argument("--records", type=int, default=800)
    p.add_argument("--work", default="/tmp/lmms-bench-memory")
    p.add_argument("--case-timeout", type=int, default=300)
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (plumbing check)")
    p.add_argument("--vl-steps", type=int, help="timed steps of the VL-3B rows (default 12)")
    p.add_argument("--vl-warmup", type=int, help="untimed first steps of the VL-3B rows (3)")
    p.add_argument("--src", help="another checkout (e.g. `git archive` of an earlier commit) whose "
                   "packages the runs import: a before-row in the same call")  # fmt: skip
    p.add_argument("--tag", default="", help="appended to each row's case name (and run folder)")
    p.add_argument("--json", default="bench_memory_plan.json", help="file name under $OUT")
    cli = p.parse_args()
    sys.path[1:1] = src_paths()  # lmms_train in this process: check-data's counter
    work = Path(cli.work)
    for kind in sorted({CASES[c]["data"] for c in cli.cases}):
        target = work / f"data_{kind}" / "train.parquet"
        if not target.exists():
            n = 64 if cli.tiny else cli.records
            write_parquet(make_records(n, 0, images=kind == "vl", tiny=cli.tiny), target)
    results = []
    for name in cli.cases:
        try:
            res = run_case(name, CASES[name], work, cli)
        except Exception as exc:  # one case's failure is a row, the others still run
            res = {"case": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(res), flush=True)
        results.append(res)
        if os.environ.get("OUT"):  # after every case: a call cut short keeps what ran
            out = Path(os.environ["OUT"], cli.json)
            out.write_text(json.dumps(results, indent=1))
    cols = ["case", "status", "T", "media_share", "max_step_share", "predicted_gib",
            "measured_gib", "error_pct", "moment", "tok_s", "mfu", "mfu_lm", "step_s",
            "time/forward", "time/backward", "time/optimizer"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    for r in results:
        if r.get("auto"):
            print(f"{r['case']}: memory: auto chose {r['auto']}")


if __name__ == "__main__":
    main()
