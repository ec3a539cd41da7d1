"""Plain transformers on bench_train's VL records: the baseline rows `hf_sdpa` / `hf_sdpa_liger`.

Upstream Qwen2.5-VL on the *same records* processed by the same processor: padded batches (each
holding the samples that fill about one pack; `--hf-micro-tokens` cuts them into micro-batches
with gradient accumulation, as it would need to fit), sdpa attention, fp32 master weights with
bf16 autocast, gradient checkpointing, fused AdamW; with and without Liger's own
`apply_liger_kernel_to_qwen2_5_vl`. Called by bench_train.py (`run_baseline`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

PEAK = 989e12  # H100/H200 dense bf16 datasheet, as peers report MFU


def _baseline_batches(work: Path, args, T: int, n_batches: int):
    """Padded batches of the same processed records, each about one pack's worth of tokens."""
    import pyarrow.parquet as pq

    from lmms_data import BadRecordError, DatasetConfig, build_processor

    dcfg = DatasetConfig.from_dict(
        {
            "dataset_path": str(work / "data_vl" / "train.parquet"),
            "min_pixels": 56 * 56 if args.tiny else 224 * 224,
            "max_pixels": 84 * 84 if args.tiny else 672 * 672,
        }
    )
    proc = build_processor("qwen2_5_vl", str(work / "processor_qwen2_5_vl"), dcfg)
    table = pq.read_table(work / "data_vl" / "train.parquet")
    batches, cur, tokens = [], [], 0
    for msgs, imgs in zip(table["messages"].to_pylist(), table["images"].to_pylist(), strict=True):
        messages = json.loads(msgs)
        for m in messages:
            for part in m["content"]:
                if part["type"] == "image":
                    part["image"] = imgs.pop(0)
        try:
            s = proc(messages)
        except BadRecordError:
            continue
        if cur and tokens + s["length"] > T:
            batches.append(cur)
            cur, tokens = [], 0
            if len(batches) == n_batches:
                break
        cur.append(s)
        tokens += s["length"]
    return batches


def _micro_batches(group: list[dict], max_tokens: int) -> list[list[dict]]:
    """`group` in order, cut so that each part's padded size (rows x longest) stays within
    `max_tokens` (0: one part; a sample longer than that is a part of its own)."""
    if max_tokens <= 0:
        return [group]
    parts: list[list[dict]] = [[]]
    for s in group:
        rows, longest = len(parts[-1]) + 1, max([s["length"], *(x["length"] for x in parts[-1])])
        if parts[-1] and rows * longest > max_tokens:
            parts.append([])
        parts[-1].append(s)
    return parts


def _padded_batch(group: list[dict], pad: int, dev: str) -> dict:
    """Right-padded `input_ids`/`labels`/`attention_mask` rows and the group's images."""
    import numpy as np
    import torch

    def cat(key: str):
        return torch.from_numpy(np.concatenate([s[key] for s in group])).to(dev)

    L = max(s["length"] for s in group)
    ids = np.full((len(group), L), pad, dtype=np.int64)
    lab = np.full((len(group), L), -100, dtype=np.int64)
    mask = np.zeros((len(group), L), dtype=np.int64)
    for r, s in enumerate(group):
        n = s["length"]
        ids[r, :n], lab[r, :n], mask[r, :n] = s["input_ids"], s["labels"], 1
    return {
        "input_ids": torch.from_numpy(ids).to(dev),
        "labels": torch.from_numpy(lab).to(dev),
        "attention_mask": torch.from_numpy(mask).to(dev),
        "pixel_values": cat("pixel_values"),
        "image_grid_thw": cat("image_grid_thw"),
    }


def run_baseline(name: str, case: dict, work: Path, args) -> dict:
    import numpy as np
    import torch

    from lmms_models import get_model_spec

    dev = "cpu" if args.tiny else "cuda"
    T = 1024 if args.tiny else case["T"]
    batches = _baseline_batches(work, args, T, args.warmup + args.steps)
    spec = get_model_spec("qwen2_5_vl")
    info = json.loads((work / "processor_qwen2_5_vl" / "lmms_token_ids.json").read_text())
    conf = spec.tiny_config() if args.tiny else spec.preset("3b")
    for k, v in info.items():
        if k.endswith("_token_id") and isinstance(v, int) and k in conf:
            conf[k] = v
    if args.tiny:
        conf["vision_config"].update(patch_size=14, window_size=112)
    torch.manual_seed(0)
    model = spec.build(config=conf, device=dev, attn_backend="sdpa")
    if case["liger"]:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

            apply_liger_kernel_to_qwen2_5_vl(model=model)
        except Exception as exc:
            return {"case": name, "status": "error", "error": f"liger: {exc}"[:300]}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
    pad = int(conf.get("pad_token_id") or 0)
    times, toks, flops, flops_lm = [], 0, 0.0, 0.0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        for i, group in enumerate(batches):
            grid = np.concatenate([s["image_grid_thw"] for s in group])
            micro = _micro_batches(group, args.hf_micro_tokens)
            # tokens the model's loss averages over: labels after its shift (the first is unused)
            n_labels = sum(int((np.asarray(s["labels"])[1:] != -100).sum()) for s in group)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for part in micro:  # gradient accumulation: the step's loss is the group's mean
                batch = _padded_batch(part, pad, dev)
                share = int((batch["labels"][:, 1:] != -100).sum()) / max(n_labels, 1)
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    loss = model(**batch).loss * share
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                lens = [s["length"] for s in group]
                times.append(time.perf_counter() - t0)
                toks += sum(lens)
                flops_lm += spec.lm_flops(model.config, lens)
                flops += spec.vision_flops(model.config, grid)
    except torch.OutOfMemoryError:
        return {"case": name, "status": "OOM"}
    dt = sum(times)
    return {
        "case": name,
        "status": "ok",
        "steps": len(times),
        "T": T,
        "tok_s": round(toks / dt),
        "mfu": round((flops + flops_lm) / dt / PEAK, 4),
        "mfu_lm": round(flops_lm / dt / PEAK, 4),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else 0.0,
        "step_s": round(dt / len(times), 3),
        "batch_rows": round(sum(len(g) for g in batches) / len(batches), 1),
        "micro_tokens": args.hf_micro_tokens,
    }
