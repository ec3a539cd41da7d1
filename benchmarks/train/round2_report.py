"""Issue 29's rows and target verdicts from the `round2` stages' bench_train JSON files.

    python benchmarks/train/round2_report.py OUT*/bench_train-r2*.json

The stages (benchmarks/device/session.sh, `r2*`) tag every row: `-before` (the levers off: what
the trainer did before issue 29) and `-after` (`--loss-rows labelled --gc-control
--compile-warmup`) of one case in one machine session; `-adamw<i>` / `-muon<i>` for the three
interleaved Muon/AdamW pairs; `-coldbefore` / `-coldafter` for the 30-step runs on empty caches.
Each verdict reads the `-after` row and names its same-run baseline; a target reads the standard
MFU (causal attention counted whole, as peers report), and the table shows both conventions,
the mean and the steady figures (the steady ones differ only where a step was over 3x the
median: `bench_train.summarize`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# case -> [(figure, threshold)]: the MFU targets (standard convention)
TARGETS = {
    "vl3b_16k": [("mfu", 0.55), ("mfu_lm", 0.44)],
    "vl3b_32k": [("mfu", 0.52)],
    "text3b_16k": [("mfu", 0.62)],
    "text1p5b_16k": [("mfu", 0.58)],
    "vl7b_16k": [("mfu", 0.40)],
}
COLS = ["row", "status", "tok_s", "mfu", "mfu_causal_half", "mfu_lm", "mfu_all_rows", "peak_gib",
        "step_s", "step_s_median", "steady step_s", "mean_over_median", "gc_full", "new_graphs",
        "levers"]  # fmt: skip


def load(paths: list[Path]) -> dict[str, dict]:
    """Row name (case + tag) -> its last row in the files given."""
    rows: dict[str, dict] = {}
    for path in paths:
        for r in json.loads(path.read_text()):
            rows[r["case"]] = {**r, "file": path.name}
    return rows


def cell(r: dict, col: str) -> str:
    if col == "row":
        return r["case"]
    if col == "steady step_s":
        return str(r["steady"]["step_s"]) if "steady" in r else "-"
    v = r.get(col, "-")
    return f"{v:.1%}" if isinstance(v, float) and col.startswith("mfu") else str(v)


def table(rows: list[dict]) -> list[str]:
    out = ["| " + " | ".join(COLS) + " |", "|" + " --- |" * len(COLS)]
    return out + ["| " + " | ".join(cell(r, c) for c in COLS) + " |" for r in rows]


def verdicts(rows: dict[str, dict]) -> list[list[str]]:
    out = []
    for case, targets in TARGETS.items():
        after, before = rows.get(f"{case}-after"), rows.get(f"{case}-before")
        if case == "vl7b_16k":
            before = rows.get("vl7b_16k_fp32state-after")
        for key, want in targets:
            if after is None or after.get("status") != "ok":
                status = "not measured" if after is None else after.get("status", "?")
                out.append([case, f"{key} >= {want:.0%}", status, "not met"])
                continue
            got = after[key]
            base = "-"
            if before is not None:
                base = f"{before.get(key, 0):.1%}" if before.get("status") == "ok" else before.get(
                    "status", "?"
                )  # fmt: skip
            out.append([case, f"{key} >= {want:.0%}", f"{got:.1%} (before, same run: {base})",
                        "met" if got >= want else "not met"])  # fmt: skip
    out += muon_verdict(rows) + cold_verdict(rows)
    return out


def muon_verdict(rows: dict[str, dict]) -> list[list[str]]:
    """Muon within 10% of AdamW at 32k: median over the three pairs of each one's median step."""
    m = [rows[k]["step_s_median"] for k in rows if k.startswith("vl3b_32k_muon-muon")
         and rows[k].get("status") == "ok"]  # fmt: skip
    a = [rows[k]["step_s_median"] for k in rows if k.startswith("vl3b_32k-adamw")
         and rows[k].get("status") == "ok"]  # fmt: skip
    if not m or not a:
        return [["vl3b_32k", "Muon within 10% of AdamW", "not measured", "not met"]]
    ratio = statistics.median(m) / statistics.median(a) - 1
    text = (f"+{ratio:.1%} (Muon {statistics.median(m):.3f} s, spread {max(m) - min(m):.3f} over "
            f"{len(m)}; AdamW {statistics.median(a):.3f} s, spread {max(a) - min(a):.3f} over {len(a)})")  # fmt: skip
    return [["vl3b_32k", "Muon within 10% of AdamW (median of 3)", text,
             "met" if ratio <= 0.10 and len(m) >= 3 and len(a) >= 3 else "not met"]]  # fmt: skip


def cold_verdict(rows: dict[str, dict]) -> list[list[str]]:
    """Cold start: the 30-step mean within 3% of the steady figure (the median step)."""
    after, before = rows.get("vl3b_16k-coldafter"), rows.get("vl3b_16k-coldbefore")
    if after is None or after.get("status") != "ok":
        return [["vl3b_16k cold", "30-step mean within 3% of steady", "not measured", "not met"]]
    got = after["mean_over_median"] - 1
    base = (
        f"{before['mean_over_median'] - 1:+.1%}" if before and before.get("status") == "ok" else "-"
    )
    return [["vl3b_16k cold", "30-step mean within 3% of steady",
             f"{got:+.1%} (before, same run: {base}; {after['steps']} steps)",
             "met" if got <= 0.03 and after["steps"] >= 30 else "not met"]]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    rows = load(p.parse_args().files)
    print("\n".join(table(list(rows.values()))))
    print()
    print("| case | target | measured | verdict |")
    print("| --- | --- | --- | --- |")
    for v in verdicts(rows):
        print("| " + " | ".join(v) + " |")


if __name__ == "__main__":
    main()
