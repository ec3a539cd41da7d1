"""Packing speed (items/s on one core) and fill ratio for every lmms-pack strategy.

Lengths: ``--n`` draws from a log-normal with median ``--median`` tokens and shape ``--sigma``
(1.0: p90 ~5k, p99 ~15k tokens, like multimodal SFT mixes of text, image and video samples),
rounded and clipped to ``[1, capacity]`` so the tail reaches the capacity. ``--sigma`` may be
given several times; each distribution gets its own table.

Paths measured for the streaming strategies (``StreamPacker.pack``):
  ints      items are the int lengths (``length=None``)
  getter    items are sample dicts, ``length=operator.itemgetter("length")``
  lambda    items are sample dicts, ``length=lambda s: s["length"]``
and ``pack_lengths`` (offline: numpy array in, lists of indices out) for every strategy.
items/s is items / CPU seconds of this process (best of ``--repeat``), pinned to one core;
wall-clock items/s is shown beside it (it also counts other processes' turns on this core).

    python benchmarks/pack/bench_pack.py            # print
    python benchmarks/pack/bench_pack.py --write    # and replace our section of RESULTS.md
"""

from __future__ import annotations

import argparse
import math
import operator
import random
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness

from lmms_pack import STRATEGIES, STREAM_STRATEGIES, StreamPacker, pack_lengths
from lmms_pack.demo import long_tailed_lengths

TITLE = "lmms-pack: packing speed and fill (benchmarks/pack/bench_pack.py)"


def drain(packer: StreamPacker, items, length) -> None:
    for _ in packer.pack(items, length):
        pass


def bench_distribution(args, sigma: float) -> tuple[str, dict]:
    lengths = long_tailed_lengths(
        args.n, args.capacity, median=args.median, sigma=sigma, seed=args.seed
    )
    ints = lengths.tolist()
    dicts = [{"length": n} for n in ints]
    getter = operator.itemgetter("length")
    cap, bins = args.capacity, args.open_bins
    paths = {
        "ints": (ints, None),
        "getter": (dicts, getter),
        "lambda": (dicts, lambda s: s["length"]),
    }
    rows, summary = [], {}
    for strategy in STRATEGIES:
        cases = [(p, strategy) for p in paths] if strategy in STREAM_STRATEGIES else []
        cases.append(("pack_lengths", strategy))
        for path, _ in cases:
            holder: dict = {}
            if path == "pack_lengths":

                def fn(strategy=strategy, holder=holder):
                    holder["stats"] = pack_lengths(lengths, cap, strategy, max_open_bins=bins).stats
            else:
                items, length = paths[path]

                def fn(strategy=strategy, items=items, length=length, holder=holder):
                    p = StreamPacker(cap, strategy, bins)
                    drain(p, items, length)
                    holder["stats"] = p.stats

            t = harness.timeit(fn, repeat=args.repeat)
            st = holder["stats"]
            assert st.items == args.n, (strategy, path, st)
            rate = args.n / t.cpu_best
            summary[(strategy, path)] = (rate, st.fill_ratio)
            rows.append(
                [
                    strategy,
                    path,
                    f"{rate:,.0f}",
                    f"{args.n / t.wall_best:,.0f}",
                    f"{st.fill_ratio:.3%}",
                    f"{st.packs:,}",
                ]
            )
            print(" | ".join(map(str, rows[-1])), flush=True)
    pct = np.percentile(lengths, [50, 90, 99])
    head = (
        f"{args.n:,} lengths, log-normal median {args.median:g} sigma {sigma:g}, clipped to "
        f"[1, {cap}]: median {pct[0]:,.0f}, p90 {pct[1]:,.0f}, p99 {pct[2]:,.0f}, "
        f"{np.mean(lengths == cap):.2%} at capacity; capacity {cap:,}, {bins} open bins "
        f"(next_fit: 1), best of {args.repeat}."
    )
    table = harness.markdown_table(
        ["strategy", "path", "items/s (CPU)", "items/s (wall)", "fill", "packs"], rows
    )
    return f"{head}\n\n{table}", summary


def stream_memory(args) -> str:
    """Peak traced memory while first_fit streams ``--n`` lengths from a generator."""
    rng = random.Random(args.seed)
    mu = math.log(args.median)

    def stream():
        for _ in range(args.n):
            yield min(args.capacity, max(1, round(rng.lognormvariate(mu, 1.0))))

    packer = StreamPacker(args.capacity, "first_fit", args.open_bins)
    tracemalloc.start()
    packs = sum(1 for _ in packer.pack(stream()))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (
        f"Memory: first_fit over {args.n:,} lengths pulled from a generator (never a list): peak "
        f"traced allocation {peak / 1024:,.0f} KiB for {packs:,} packs; the state is the "
        f"{args.open_bins} open bins, whatever the stream's length."
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=32_000)
    ap.add_argument("--median", type=float, default=1500.0)
    ap.add_argument(
        "--sigma", type=float, action="append", help="log-normal shape (repeatable); default 1.0"
    )
    ap.add_argument("--open-bins", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one core")
    ap.add_argument(
        "--write", action="store_true", help="replace this benchmark's section of RESULTS.md"
    )
    args = ap.parse_args()
    sigmas = args.sigma or [1.0]
    cpu = None if args.no_pin else harness.pin_to_one_core()
    print(f"pinned to CPU {cpu}" if cpu is not None else "not pinned", flush=True)

    parts, summaries = [], []
    for sigma in sigmas:
        text, summary = bench_distribution(args, sigma)
        parts.append(text)
        summaries.append((sigma, summary))
    parts.append(stream_memory(args))

    lines = []
    for sigma, s in summaries:
        ff_rate, ff_fill = s[("first_fit", "ints")]
        fc_rate = s[("first_fit", "lambda")][0]
        nf_fill = s[("next_fit", "ints")][1]
        ok = "met" if ff_rate >= 1e6 and ff_fill >= 0.99 else "NOT met"
        lines.append(
            f"- sigma {sigma:g}: first_fit ({args.open_bins} open bins) {ff_rate:,.0f} items/s (ints), "
            f"{fc_rate:,.0f} items/s (lambda), fill {ff_fill:.2%}; next_fit fill {nf_fill:.2%} in the "
            f"same run. Target >= 1,000,000 items/s and >= 99% fill: {ok}."
        )
    lines.append(
        "- items/s (CPU) = items / CPU-seconds of the benchmark process, pinned to one core: the "
        "packer's single-core speed. items/s (wall) is lower whenever other processes share that "
        "core (see the load average above); on an idle core the two agree."
    )
    parts.insert(0, "Summary:\n\n" + "\n".join(lines))
    body = "\n\n".join(parts)
    print("\n" + body)
    if args.write:
        command = "python benchmarks/pack/bench_pack.py " + " ".join(sys.argv[1:])
        harness.write_section(TITLE, body, command=command.strip())
        print(f"\nwrote section to {harness.RESULTS}")


if __name__ == "__main__":
    main()
