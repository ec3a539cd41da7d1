"""Issue 8's table and verdicts from one device session's files.

    python benchmarks/train/issue8_report.py --bench OUT1/bench_train-master.json OUT2/... \
        --calib-vl OUT3/calib_vl.txt --calib-text OUT3/calib_text.txt

Reads `bench_train.py`'s JSON rows (lmms cases and the plain-transformers baselines) and the
calibration scripts' `RESULT {...}` lines, and prints the rows and each target's verdict in
Markdown, for RESULTS.md. A row is picked per case by its name before the tag (`vl3b_16k-master`
is `vl3b_16k`) and its gradient accumulation (a GA-4 row is `vl3b_16k@ga4`: four packs per
optimizer step, so it never stands in for the GA-1 case the targets name); when a case appears
more than once the last one given wins, and the table says which row was used. Speed targets
read the steady figures when a run had a slow step (one-off compile; `bench_train.summarize`),
and say so. Muon is compared with AdamW for every case measured with both.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

TARGETS = {  # case -> (figure, threshold) for the MFU targets
    "vl3b_16k": [("mfu", 0.45), ("mfu_lm", 0.33)],
    "text3b_16k": [("mfu", 0.55)],
    "text1p5b_16k": [("mfu", 0.45)],
}


def load_rows(paths: list[Path]) -> dict[str, dict]:
    """Case key (base name, ``@ga<N>`` for N > 1) -> its last ok row (the full row name kept
    under "row"). N is the row's ``ga`` or, for rows written before bench_train recorded it, a
    ``-ga<N>`` tag."""
    rows: dict[str, dict] = {}
    for path in paths:
        for r in json.loads(path.read_text()):
            if r.get("status") == "ok":
                row = with_steady({**r, "row": r["case"], "file": path.name})
                tag = re.search(r"-ga(\d+)\b", r["case"])
                ga = int(r.get("ga") or (tag.group(1) if tag else 1))
                base = r["case"].split("-")[0]
                rows[base if ga == 1 else f"{base}@ga{ga}"] = row
    return rows


def read_calibration(path: Path | None) -> dict | None:
    if path is None or not path.exists():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1].removeprefix("RESULT ")) if lines else None


def with_steady(r: dict) -> dict:
    """The row with its `steady` figures, derived from `step_s_each` for rows written before
    bench_train computed them (same 3x-median rule; tokens per step taken as equal: the packs
    are full)."""
    times = r.get("step_s_each")
    if "steady" in r or not times:
        return r
    median = statistics.median(times)
    kept = [t for t in times if t <= 3 * median]
    if len(kept) == len(times):
        return r
    scale = r["step_s"] / statistics.mean(kept)
    figures = {k: round(r[k] * scale, 4) for k in ("mfu", "mfu_lm")}
    figures |= {"tok_s": round(r["tok_s"] * scale), "step_s": round(statistics.mean(kept), 3)}
    return {**r, "steady": {"steps": len(kept), **figures}}


def steady(r: dict) -> dict:
    """The figures speed targets read: without slow steps when the run had any."""
    return {**r, **r["steady"]} if "steady" in r else r


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(rows: dict[str, dict]) -> list[str]:
    out = [
        "| case (row, file) | tok/s | total MFU | LM-only MFU | peak GiB | data wait | step s "
        "| steady tok/s (steps) | steady MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, r in rows.items():
        s = r.get("steady")
        steady_tok = f"{s['tok_s']:,} ({s['steps']})" if s else "-"
        out.append(
            f"| {case} ({r['row']}, {r['file']}) | {r['tok_s']:,} | {pct(r['mfu'])} "
            f"| {pct(r['mfu_lm'])} | {r.get('peak_gib', '-')} "
            f"| {pct(r['data_wait']) if 'data_wait' in r else '-'} | {r['step_s']} "
            f"| {steady_tok} "
            f"| {pct(s['mfu']) if s else '-'} |"
        )
    return out


def verdicts(rows: dict[str, dict], calib_vl: dict | None, calib_text: dict | None) -> list[str]:
    out = ["| target | measured | verdict |", "| --- | --- | --- |"]

    def add(target: str, measured: str, ok: bool | None) -> None:
        verdict = "not measured" if ok is None else ("met" if ok else "not met")
        out.append(f"| {target} | {measured} | {verdict} |")

    for case, checks in TARGETS.items():
        r = rows.get(case)
        for key, floor in checks:
            name = f"{case} {'total' if key == 'mfu' else 'LM-only'} MFU >= {pct(floor)}"
            if r is None:
                add(name, "-", None)
                continue
            s = steady(r)
            note = f" (steady, {s['steps']} steps; all: {pct(r[key])})" if "steady" in r else ""
            add(name, pct(s[key]) + note, s[key] >= floor)
    vl = rows.get("vl3b_16k")
    vl_tok = steady(vl)["tok_s"] if vl else None
    base = calib_vl["tok_s"] if calib_vl else None
    add(
        "vl3b_16k >= 1.6x calibration",
        f"{vl_tok:,} / {base:,} = {vl_tok / base:.2f}x" if vl_tok and base else "-",
        vl_tok / base >= 1.6 if vl_tok and base else None,
    )
    for ref in ("hf_sdpa", "hf_sdpa_liger"):
        hf = rows.get(ref)
        ratio = vl_tok / hf["tok_s"] if vl_tok and hf else None
        add(
            f"vl3b_16k >= 10x plain transformers ({ref})",
            f"{vl_tok:,} / {hf['tok_s']:,} = {ratio:.1f}x" if ratio else "-",
            ratio >= 10 if ratio else None,
        )
    text = rows.get("text3b_16k")
    if text and calib_text:
        out.append(
            f"| text3b_16k vs its calibration (no target) | {steady(text)['tok_s']:,} / "
            f"{calib_text['tok_s']:,} = {steady(text)['tok_s'] / calib_text['tok_s']:.2f}x | - |"
        )
    pairs = [(c.replace("_muon", ""), c) for c in rows if "_muon" in c]
    pairs = [(a, m) for a, m in pairs if a in rows] or [("vl3b_16k", "vl3b_16k_muon")]
    for adamw, muon in sorted(pairs):
        name = f"Muon step within 10% of AdamW ({adamw})"
        if adamw not in rows or muon not in rows:
            add(name, "-", None)
            continue
        extra = steady(rows[muon])["step_s"] / steady(rows[adamw])["step_s"] - 1
        add(name, f"{100 * extra:+.1f}%", extra <= 0.10)
    lmms = [r for c, r in rows.items() if not c.startswith("hf_")]
    profiled = [r for r in lmms if "host_waits" in r]
    syncs = sum(r["host_waits"]["sync"]["count"] for r in profiled)
    add(
        "no host synchronisation in the profiled steps",
        f"{syncs} syncs in {len(profiled)} profiled rows" if profiled else "-",
        syncs == 0 if profiled else None,
    )
    worst = max((r["data_wait"] for r in lmms if "data_wait" in r), default=None)
    add(
        "data wait < 2% of the step (every lmms row)",
        f"at most {pct(worst)}" if worst is not None else "-",
        worst < 0.02 if worst is not None else None,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", nargs="+", type=Path, required=True, help="bench_train JSON files")
    p.add_argument("--calib-vl", type=Path, help="the VL calibration's output (RESULT line)")
    p.add_argument("--calib-text", type=Path, help="the text calibration's output")
    args = p.parse_args()
    rows = load_rows(args.bench)
    calib_vl, calib_text = read_calibration(args.calib_vl), read_calibration(args.calib_text)
    print("\n".join(table(rows)))
    if calib_vl or calib_text:
        print()
        for name, c in (("VL", calib_vl), ("text", calib_text)):
            if c:
                print(f"- calibration {name}: {c['tok_s']:,} tok/s ({json.dumps(c)})")
    print()
    print("\n".join(verdicts(rows, calib_vl, calib_text)))


if __name__ == "__main__":
    main()
