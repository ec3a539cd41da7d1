"""Every registered family on one GPU, in one device call: packed-forward parity and 8 steps of
training through the real `lmms-train` CLI (issue 36).

    python3 benchmarks/device/family_matrix.py --out $OUT            # the GPU matrix
    python3 benchmarks/device/family_matrix.py --cpu --tiny --out DIR # the plumbing, on a CPU

For every family of the registry (``lmms_models.list_models()`` plus ``unavailable_models()``,
which become failing rows):

* parity: the family's packed forward (``spec.packed_forward`` on one row of mixed samples,
  the default varlen attention backend) against the upstream model's own unpacked forward, one
  sample at a time (``lmms_models.testing`` / ``testing_audio``; BAGEL, which has no upstream
  model, against each sample alone through its own forward). Forward only, bf16 autocast on the
  GPU. PASS when the per-token losses differ by at most ``rel 1e-3`` (fp32 on the CPU: 1e-5)
  and the control moves the loss by more than 3x that difference. Why 1e-3: bf16 autocast
  rounds both sides differently (another kernel: varlen flash attention over the row vs SDPA
  per sample; another summation order); over 15 families on an H100 (2026-12-05) that moved the
  per-token loss by at most 7.6e-5, so 1e-3 leaves a 13x margin (the package GPU tests' 2e-2
  would hide most packing errors of a tiny model). Attention across samples moves the mean of a
  tiny random-init model by only 3e-4 to 9e-4 (measured in fp32 on the CPU), below any bf16
  bound: hence the control, the same row as one segment, which must differ from the reference
  by more than 3x the packed row's difference (a harness that cannot see that error fails the
  row). The exact check is the CPU parity tests (fp32, 1e-5, with their own controls).
  Flow-matching families on batched latents (no packing) have no packed forward: their row
  says so.
* training: the family's tiny example (``examples/<family>/tiny*.yaml``) through
  ``lmms_train.cli.main`` (the `lmms-train` entry point) on the GPU with bf16, the default layout
  and attention backend, a larger pack (``--packing-length``), 8 steps; the row records the
  first and last loss, the median tokens/s of steps 2.. and the peak GiB the trainer logs.

The families run in one worker process (imports paid once); a family that fails is a row,
and a worker that dies or runs past ``--family-timeout`` is restarted for the rest. Writes
``matrix.md``, ``matrix.json`` and ``matrix.log`` under ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_RTOL, CPU_RTOL = 1e-3, 1e-5


# --------------------------------------------------------------------------- parity (worker)


def _samples(spec, config, gen):
    """(samples, reference function, packer) of the family's own harness."""
    from lmms_models import testing, testing_audio

    keys = set(spec.media_keys)
    if "input_features" in keys and "pixel_values" in keys:  # omni: every modality
        Om = testing_audio.OmniSampleSpec
        ss = [
            Om(text=10, prompt=2),
            Om(text=1, prompt=0),
            Om(text=4, images=[(1, 4, 4)], audios=[150]),
        ]
        made = [testing_audio.make_omni_sample(spec, config, s, gen=gen) for s in ss]
        return made, testing_audio.audio_reference_loss_sum, testing_audio.pack_audio_samples
    if "input_features" in keys:  # audio LMs
        A = testing_audio.AudioSampleSpec
        ss = [
            A(text=12),
            A(text=1, prompt=0),
            A(text=6, audios=[[37]]),
            A(text=5, audios=[[100, 5]]),
        ]
        made = [testing_audio.make_audio_sample(spec, config, s, gen=gen) for s in ss]
        return made, testing_audio.audio_reference_loss_sum, testing_audio.pack_audio_samples
    S = testing.SampleSpec
    ss = [S(text=75), S(text=1, prompt=0), S(text=7, prompt=3)]
    if "pixel_values" in keys:
        ss += [S(text=6, images=[(1, 4, 4), (1, 2, 6)]), S(text=5, videos=[(2, 4, 4)])]
    made = [testing.make_sample(spec, config, s, gen=gen) for s in ss]
    return made, testing.reference_loss_sum, testing.pack_samples


def _to(x, device):
    import torch

    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _bagel_parity(device, autocast):
    """BAGEL (no upstream model): the mixed pack (understanding, generation, editing, text)
    against each sample packed alone, through the family's objective (its tests' material)."""
    import torch

    sys.path.insert(0, str(REPO / "packages" / "lmms-models" / "tests"))
    import _bagel_cases as cases

    from lmms_models.families.bagel import batch_to
    from lmms_models.objectives import ObjectiveContext, get_objective

    spec, model = cases.tiny_model()
    model = model.to(device)
    obj = get_objective("ce_flow_matching", ce_weight=1.0, fm_weight=1.0)
    names = cases.PACKS["mixed"]

    def run(batch):
        with torch.no_grad(), autocast():
            out = obj.loss(spec, model, batch_to(batch, device), ObjectiveContext(seed=3))
        return float(out.loss_sum)

    # the row as the trainer runs it (FlexAttention over the whole row on CUDA) against each
    # sample alone under its dense span mask (SDPA)
    packed = run(cases.pack(names, backend="auto" if device == "cuda" else "sdpa"))
    ref = sum(run(cases.pack([n], backend="sdpa")) for n in names)
    return packed, ref, len(names)


def parity(name, device, dtype_name):
    """(packed per-token loss, reference per-token loss, note, the control's relative difference:
    the same row as one segment, which must differ) for one family."""
    import contextlib

    import torch

    import lmms_kernels
    from lmms_models import DiffusionSpec, get_model_spec

    spec = get_model_spec(name)
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if dtype_name == "bf16"
        else contextlib.nullcontext
    )
    if isinstance(spec, DiffusionSpec):
        return None, None, "n/a: batched latents, no packed forward", None
    if name == "bagel":
        packed, ref, n = _bagel_parity(device, autocast)
        return packed, ref, f"mixed pack vs {n} samples alone", None
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), device=device, attn_backend="sdpa")
    gen = torch.Generator().manual_seed(1)
    samples, reference, packer = _samples(spec, model.config, gen)
    total = sum(s["input_ids"].numel() for s in samples)
    batch = packer(spec, model, samples, pad_to=total + 3)
    samples = [_to(s, device) for s in samples]
    with torch.no_grad(), autocast():
        ref, n_ref = reference(spec, model, samples)
    backend = "varlen_sdpa" if device == "cpu" else lmms_kernels.resolve_backend("auto", device)
    spec.set_attention(model, backend=backend)
    with torch.no_grad(), autocast():
        loss, count = spec.packed_forward(model, _to(batch, device))
        # the control: one segment for the whole row (attention across samples) must differ
        n = int(batch["cu_seqlens"][-1])
        bad = dict(batch, cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
        wrong, _ = spec.packed_forward(model, _to(bad, device))
    if int(count) != n_ref:
        raise AssertionError(f"packed counts {int(count)} supervised tokens, upstream {n_ref}")
    control = abs(float(wrong) - float(ref)) / max(abs(float(ref)), 1e-12)
    return float(loss) / n_ref, float(ref) / n_ref, f"{len(samples)} samples, {backend}", control


# --------------------------------------------------------------------------- training (worker)


def _example(name):
    folder = REPO / "examples" / name
    found = sorted(folder.glob("tiny_cpu.yaml")) or sorted(folder.glob("*tiny*.yaml"))
    return found[0] if found else None


def _inputs(name, work):
    """(example, its YAML, overrides placing its data and processor folders under ``work``)."""
    import yaml

    example = _example(name)
    if example is None:
        raise FileNotFoundError(f"no tiny example under examples/{name}/")
    raw = yaml.safe_load(example.read_text())
    m, d = raw["model_config"], raw["dataset_config"]
    over = []
    for key, section in (("processor_path", "model_config"), ("dataset_path", "dataset_config")):
        value = (m if section == "model_config" else d).get(key)
        if value:  # the example's shared folders stay shared, under the work folder
            folder = re.sub(r"[^A-Za-z0-9]+", "_", str(Path(value).parent)).strip("_")
            over.append(f"{section}.{key}={work / folder / Path(value).name}")
    return example, raw, over


def prepare(name, args, work):
    """The family's synthetic data and local processor, made here (``lmms-train check-data``)
    so that the GPU call carries them and spends no device time (nor needs soundfile) on them."""
    from lmms_train.cli import main

    example, raw, over = _inputs(name, work)
    if args.tiny and isinstance(raw["dataset_config"].get("generate_synthetic"), dict):
        over.append("dataset_config.generate_synthetic.num_samples=64")
    try:
        code = main(["check-data", str(example), *over, "--num-records", "1"])
    except Exception as exc:  # check-data reads no latent datasets (sit, wan): the data is made
        code = f"{type(exc).__name__}: {exc}"
    data = next((o.split("=", 1)[1] for o in over if "dataset_path=" in o), None)
    if code != 0 and not (data and Path(data).exists()):
        raise RuntimeError(f"lmms-train check-data: {code}")


def train(name, args, work):
    """8 steps of the family's tiny example through the CLI; the metrics rows of the steps."""
    from lmms_train.cli import main

    example, raw, over = _inputs(name, work)
    d = raw["dataset_config"]
    run_dir = Path(tempfile.gettempdir()) / "family_matrix_runs" / name  # never a used folder
    shutil.rmtree(run_dir, ignore_errors=True)
    over.append(f"trainer_args.output_dir={run_dir}")
    over += [
        f"trainer_args.max_steps={args.steps}", "trainer_args.warmup_steps=1",
        "trainer_args.save_steps=0", "trainer_args.save_final=false",
        "trainer_args.export_hf=false", "trainer_args.eval_steps=0",
        "trainer_args.report_to=[]", "trainer_args.logging_steps=1",
        f"trainer_args.device={'cpu' if args.cpu else 'cuda'}",
        f"trainer_args.bf16={'false' if args.cpu else 'true'}",
    ]  # fmt: skip
    if "packing_length" in d and args.packing_length:
        over.append(f"dataset_config.packing_length={args.packing_length}")
    if args.tiny and isinstance(d.get("generate_synthetic"), dict):
        over.append("dataset_config.generate_synthetic.num_samples=64")
    code = main([str(example), *over])
    if code != 0:
        raise RuntimeError(f"lmms-train exited {code}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r], example.name


def _summary(rows):
    losses = [r["loss"] for r in rows]
    tps = [r["tokens_per_sec"] for r in rows[1:] if r.get("tokens_per_sec")]
    peak = max((r.get("peak_memory_gb") or 0.0) for r in rows) if rows else 0.0
    return {
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "steps": len(rows),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "peak_gib": peak,
    }


def run_family(name, args, work):
    import gc

    import torch

    row = {"family": name}
    rtol = CPU_RTOL if args.cpu else GPU_RTOL
    device = "cpu" if args.cpu else "cuda"
    t0 = time.perf_counter()
    try:
        packed, ref, note, control = parity(name, device, "fp32" if args.cpu else "bf16")
        row.update(parity_note=note, control_rel=control)
        if packed is not None:
            rel = abs(packed - ref) / max(abs(ref), 1e-12)
            ok = rel <= rtol and (control is None or control > 3 * rel)  # it can see an error
            row.update(packed=packed, reference=ref, rel_diff=rel, parity_ok=ok)
    except Exception as exc:  # a row, not a stop
        row.update(parity_ok=False, parity_error=f"{type(exc).__name__}: {exc}"[:300])
    row["parity_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        rows, example = train(name, args, work)
        row.update(_summary(rows), example=example)
        ok = row["steps"] == args.steps and row["loss_last"] < row["loss_first"]
        row["train_ok"] = bool(ok)
    except Exception as exc:
        row.update(train_ok=False, train_error=f"{type(exc).__name__}: {exc}"[:300])
    finally:  # the trainer's GC control froze and disabled the collector
        gc.unfreeze()
        gc.enable()
        gc.collect()
    row["train_s"] = time.perf_counter() - t0
    return row


def worker(args):
    out = Path(args.out)
    work = Path(args.work).resolve() if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    for name in args.families.split(","):
        print(f"=== {name}", flush=True)
        if args.prepare:
            row = {"family": name, "train_ok": True}
            try:
                prepare(name, args, work)
            except Exception as exc:
                row.update(train_ok=False, train_error=f"{type(exc).__name__}: {exc}"[:300])
        else:
            row = run_family(name, args, work)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"=== {name} done: {json.dumps(row)}", flush=True)
        if not args.cpu:
            import torch

            try:
                torch.cuda.synchronize()
            except Exception:  # a sticky CUDA error: the next worker starts clean
                sys.exit(3)


# --------------------------------------------------------------------------- parent


def _families():
    from lmms_models import list_models, unavailable_models

    return list_models(), unavailable_models()


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows, rtol):
    head = (
        "| family | parity (rel diff / tol) | loss first -> last | tokens/s | peak GiB | result |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "rel_diff" in r:
            par = f"{'PASS' if r['parity_ok'] else 'FAIL'} {r['rel_diff']:.1e} / {rtol:.0e}"
            if r.get("control_rel") is not None:
                par += f" (control {r['control_rel']:.0e})"
        elif "parity_error" in r:
            par = f"ERROR {r['parity_error'][:80]}"
        else:
            par = r.get("parity_note", "-")
        if r.get("train_error"):
            tr = f"ERROR {r['train_error'][:100]}"
        else:
            tr = f"{_fmt(r.get('loss_first'), '.3f')} -> {_fmt(r.get('loss_last'), '.3f')}"
        ok = r.get("parity_ok", True) is not False and r.get("train_ok", False)
        lines.append(
            f"| {r['family']} | {par} | {tr} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(r.get('peak_gib'), '.2f')} | {'pass' if ok else 'FAIL'} |"
        )
    return head + "\n".join(lines) + "\n"


def parent(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").unlink(missing_ok=True)
    names, unavailable = _families()
    if args.families:
        names = [n for n in names if n in args.families.split(",")]
    last = args.last.split(",")  # the slow first compilations last: a cut budget spares the rest
    names = sorted(names, key=lambda n: (n in last, n))
    start = time.monotonic()
    log = open(out / "matrix.log", "a")  # noqa: SIM115 - the workers' output, to the end
    todo = list(names)
    while todo and time.monotonic() - start < args.budget:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--families",
            ",".join(todo),
            *_passthrough(args),
        ]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        seen = _done(out)
        last = time.monotonic()
        while proc.poll() is None:
            time.sleep(1)
            now = _done(out)
            if len(now) != len(seen):
                seen, last = now, time.monotonic()
            over = time.monotonic() - start > args.budget
            if time.monotonic() - last > args.family_timeout or over:
                proc.kill()
                proc.wait()
                stuck = next(n for n in todo if n not in now)
                why = "over the call's budget" if over else f"over {args.family_timeout:.0f} s"
                _append(out, {"family": stuck, "train_ok": False, "parity_ok": False,
                              "train_error": f"killed: {why}"})  # fmt: skip
                break
        todo = [n for n in todo if n not in _done(out)]
    rows = {r["family"]: r for r in _read(out)}
    for n in todo:
        rows[n] = {"family": n, "train_ok": False, "train_error": "not run: budget spent"}
    for n, why in unavailable.items():
        rows[n] = {"family": n, "parity_ok": False, "train_ok": False, "train_error": why}
    ordered = [rows[n] for n in sorted(rows)]
    rtol = CPU_RTOL if args.cpu else GPU_RTOL
    md = table(ordered, rtol)
    meta = _meta(args, time.monotonic() - start)
    (out / "matrix.json").write_text(json.dumps({"meta": meta, "rows": ordered}, indent=1))
    (out / "matrix.md").write_text(f"{meta['line']}\n\n{md}")
    print(meta["line"])
    print(md)
    return 0 if all(r.get("train_ok") and r.get("parity_ok", True) for r in ordered) else 1


def _passthrough(args):
    out = [
        "--out",
        args.out,
        "--steps",
        str(args.steps),
        "--packing-length",
        str(args.packing_length),
    ]
    out += ["--work", args.work] if args.work else []
    out += ["--prepare"] if args.prepare else []
    return out + (["--cpu"] if args.cpu else []) + (["--tiny"] if args.tiny else [])


def _read(out):
    path = out / "rows.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _done(out):
    return {r["family"] for r in _read(out)}


def _append(out, row):
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _meta(args, seconds):
    import torch
    import transformers

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else "cpu"
    line = (
        f"family matrix: {card}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{args.steps} steps, packing_length {args.packing_length or 'as the example'}, "
        f"{seconds:.0f} s"
    )
    return {"card": card, "line": line, "seconds": seconds}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/family_matrix")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (fp32 parity)")
    p.add_argument("--tiny", action="store_true", help="fewer synthetic samples (plumbing check)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--packing-length", type=int, default=2048, help="0: the example's")
    p.add_argument("--families", default="", help="comma-separated subset (default: all)")
    p.add_argument("--family-timeout", type=float, default=120.0)
    p.add_argument(
        "--last",
        default="bagel,fla_gated_deltanet,qwen3_5,qwen3_5_moe",
        help="families run after the others (Triton/tilelang/Flex compilation on first use)",
    )
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole matrix")
    p.add_argument("--work", default="", help="data/processor/run folder (default: OUT/work)")
    p.add_argument(
        "--prepare", action="store_true", help="only make every family's data and processor"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.worker:
        return worker(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
