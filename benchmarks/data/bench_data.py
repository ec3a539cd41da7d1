"""lmms-data: time to the first packed batch and peak RSS on a large vs a 10x smaller Parquet
dataset, and image-pipeline samples/s per worker (vs the HF processor called per sample).

    uv run --all-packages --all-extras python benchmarks/data/bench_data.py --large-gb 10 --write

Data is generated fast (a few distinct noise PNGs repeated with varying text; Parquet, no
compression), measured in fresh subprocesses (so peak RSS is per run), then deleted unless --keep.
Targets (issue): first batch < 3 s on the large dataset; peak RSS large <= 1.2x small.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness

ROWS_PER_FILE = 768
ROWS_PER_GROUP = 64


def _pngs(k: int, size: int) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(k):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
            buf, format="PNG"
        )
        out.append(buf.getvalue())
    return out


def generate(out: str, gb: float, image_size: int) -> dict:
    """Write ~``gb`` GB of Parquet shards; returns {"rows", "bytes", "seconds"}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    imgs = _pngs(8, image_size)
    per_row = sum(map(len, imgs)) / len(imgs)
    rows = max(ROWS_PER_GROUP, int(gb * 1e9 / per_row))
    schema = pa.schema([("messages", pa.string()), ("images", pa.list_(pa.binary()))])
    done, f = 0, 0
    while done < rows:
        n = min(ROWS_PER_FILE, rows - done)
        with pq.ParquetWriter(
            os.path.join(out, f"shard-{f:05d}.parquet"),
            schema,
            compression="none",
            use_dictionary=False,
        ) as w:
            for g in range(0, n, ROWS_PER_GROUP):
                m = min(ROWS_PER_GROUP, n - g)
                ids = range(done + g, done + g + m)
                msgs = [json.dumps([
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Describe picture {i}."}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"Noise number {i % 97} " * (1 + i % 5)}]},
                ]) for i in ids]  # fmt: skip
                w.write_table(
                    pa.table(
                        {"messages": msgs, "images": [[imgs[i % 8]] for i in ids]}, schema=schema
                    )
                )
        done += n
        f += 1
    size = sum(p.stat().st_size for p in Path(out).glob("*.parquet"))
    return {"rows": rows, "bytes": size, "seconds": time.perf_counter() - t0}


def measure(path: str, proc: str, batches: int, packing_length: int) -> dict:
    """Runs in a fresh process: first-batch latency, then peak RSS after ``batches`` batches."""
    t0 = time.perf_counter()
    import lmms_data as ld

    cfg = ld.DatasetConfig(dataset_path=path, packing_length=packing_length, shuffle_buffer=256,
                           max_pixels=448 * 448, num_workers=0)  # fmt: skip
    processor = ld.build_processor("qwen2_5_vl", proc, cfg)  # imports transformers: not data time
    t1, c1 = time.perf_counter(), time.process_time()
    it = iter(ld.build_dataloader(cfg, processor, num_workers=0))
    first = next(it)
    t2, c2 = time.perf_counter(), time.process_time()
    for _ in range(batches - 1):
        next(it)
    t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB on Linux
    return {"processor_load_s": t1 - t0, "first_batch_s": t2 - t1, "first_batch_cpu_s": c2 - c1,
            "first_batch_samples": int(first["num_samples"]), "load_avg": os.getloadavg()[0], "batches_per_s": (batches - 1) / (t3 - t2),
            "peak_rss_mib": rss}  # fmt: skip


def pipeline_rate(proc: str, n: int, image_size: int) -> tuple[float, float]:
    """(lmms samples/s, HF processor samples/s) for record -> sample on one core."""
    from PIL import Image
    from transformers import AutoProcessor

    import lmms_data as ld

    p = ld.build_processor("qwen2_5_vl", proc, max_pixels=448 * 448)
    imgs = _pngs(8, image_size)
    msgs = lambda i: [  # noqa: E731
        {"role": "user", "content": [{"type": "image", "image": imgs[i % 8]}, {"type": "text", "text": f"Describe {i}."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Noise."}]},
    ]  # fmt: skip
    t = harness.timeit(lambda: [p(msgs(i)) for i in range(n)], repeat=2, warmup=1)
    hf = AutoProcessor.from_pretrained(proc)
    text = hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe 0."}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Noise."}]}], tokenize=False)  # fmt: skip

    def hf_run():
        for i in range(n):
            img = Image.open(io.BytesIO(imgs[i % 8])).convert("RGB")
            hf(text=[text], images=[img], return_tensors="np",
               images_kwargs={"size": {"shortest_edge": 3136, "longest_edge": 448 * 448}})  # fmt: skip

    th = harness.timeit(hf_run, repeat=2, warmup=1)
    return n / t.cpu_best, n / th.cpu_best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large-gb", type=float, default=10.0)
    ap.add_argument("--root", default=os.environ.get("LMMS_BENCH_DATA", "/tmp/lmms_bench_data"))
    ap.add_argument("--image-size", type=int, default=336)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--packing-length", type=int, default=4096)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--write", action="store_true", help="write the section of benchmarks/RESULTS.md"
    )
    ap.add_argument("--measure", nargs=2, metavar=("DATA", "PROC"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], a.measure[1], a.batches, a.packing_length)))
        return
    import lmms_data as ld

    root = Path(a.root)
    proc = ld.build_local_processor(str(root / "proc"))["path"]
    free = shutil.disk_usage(root).free / 1e9
    if free < a.large_gb * 1.2 + 2:
        raise SystemExit(f"only {free:.0f} GB free under {root}; lower --large-gb")
    results = {}
    for name, gb in (("small", a.large_gb / 10), ("large", a.large_gb)):
        d = root / name
        gen = json.loads((d / "gen.json").read_text()) if (d / "gen.json").exists() else None
        if gen is None or abs(gen["bytes"] / 1e9 - gb) > 0.2 * gb:
            shutil.rmtree(d, ignore_errors=True)
            gen = generate(str(d), gb, a.image_size)
            (d / "gen.json").write_text(json.dumps(gen))
        print(
            f"{name}: {gen['bytes'] / 1e9:.2f} GB, {gen['rows']} rows (generated in {gen['seconds']:.0f} s)",
            flush=True,
        )
        out = subprocess.run(
            [sys.executable, __file__, "--measure", str(d), proc, "--batches", str(a.batches),
             "--packing-length", str(a.packing_length)], check=True, capture_output=True, text=True,
        )  # fmt: skip
        results[name] = {**gen, **json.loads(out.stdout.strip().splitlines()[-1])}
        print(name, results[name], flush=True)
    ours, hf = pipeline_rate(proc, 64, a.image_size)
    if not a.keep:
        shutil.rmtree(root / "small", ignore_errors=True)
        shutil.rmtree(root / "large", ignore_errors=True)
    s, lg = results["small"], results["large"]
    rows = [[n, f"{r['bytes'] / 1e9:.2f}", r["rows"], f"{r['processor_load_s']:.1f}", f"{r['first_batch_s']:.2f}",
             f"{r['first_batch_cpu_s']:.2f}", r["first_batch_samples"],
             f"{r['peak_rss_mib']:.0f}",
             f"{r['batches_per_s']:.2f}"] for n, r in results.items()]  # fmt: skip
    table = harness.markdown_table(
        [
            "dataset",
            "GB",
            "rows",
            "processor load (s)",
            "first packed batch: wall s",
            "CPU s",
            "samples",
            "peak RSS (MiB)",
            "batches/s (1 worker)",
        ],
        rows,
    )
    ratio = lg["peak_rss_mib"] / s["peak_rss_mib"]
    body = (
        f"{table}\n\nPeak RSS large/small: **{ratio:.2f}x** (target <= 1.2x); first batch on the large "
        f"dataset **{lg['first_batch_s']:.2f} s** wall, {lg['first_batch_cpu_s']:.2f} s CPU (target < 3 s; "
        f"1-min load average during the run {lg['load_avg']:.1f} on {os.cpu_count()} cores). Packing length {a.packing_length}, "
        f"{a.image_size}px noise PNGs, shuffle buffer 256, one in-process worker, {a.batches} batches. "
        "First batch is timed from `build_dataloader` (shard discovery, shuffle-buffer fill, decode, "
        "process, pack) with the processor already loaded; the processor load (mostly importing "
        "transformers/torch) is shown apart.\n\n"
        + harness.markdown_table(
            ["image pipeline (record -> sample, one core)", "samples/s"],
            [
                ["lmms-data QwenVLProcessor (pillow backend)", f"{ours:.1f}"],
                ["baseline: HF Qwen2_5_VLProcessor per sample", f"{hf:.1f}"],
            ],
        )
    )
    print(body)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_data.json").write_text(
            json.dumps({**results, "pipeline": [ours, hf]})
        )
    if a.write:
        harness.write_section("lmms-data: streaming start-up, memory and image pipeline", body,
                              command=" ".join(["python", *sys.argv]))  # fmt: skip


if __name__ == "__main__":
    main()
