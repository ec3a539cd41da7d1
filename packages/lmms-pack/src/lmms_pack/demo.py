"""``python -m lmms_pack.demo``: pack a synthetic long-tailed stream with every strategy.

Prints, per strategy, packs, fill ratio and items/s on a stream of sample lengths drawn like
multimodal SFT data (log-normal, median ~1.5k tokens, tail clipped at the capacity), then
resumes a packer mid-stream to show it emits the same packs, and collates one packed row.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np

from lmms_pack import STRATEGIES, STREAM_STRATEGIES, StreamPacker, collate_packed, pack_lengths


def long_tailed_lengths(
    n: int, capacity: int, *, median: float = 1500.0, sigma: float = 1.0, seed: int = 0
) -> np.ndarray:
    """``n`` int64 lengths, log-normal around ``median``, clipped to ``[1, capacity]``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), 1, capacity).astype(np.int64)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lmms_pack.demo", description=__doc__)
    ap.add_argument("--n", type=int, default=200_000, help="stream length (items)")
    ap.add_argument("--capacity", type=int, default=32_000)
    ap.add_argument("--open-bins", type=int, default=8)
    args = ap.parse_args(argv)
    lengths = long_tailed_lengths(args.n, args.capacity)
    print(
        f"{args.n} samples, median {int(np.median(lengths))} tokens, p99 {int(np.percentile(lengths, 99))}, "
        f"max {int(lengths.max())}; capacity {args.capacity}, {args.open_bins} open bins"
    )
    print(f"{'strategy':<10} {'mode':<8} {'packs':>8} {'fill':>8} {'items/s':>12}")
    for strategy in STRATEGIES:
        t0 = time.perf_counter()
        packs = pack_lengths(lengths, args.capacity, strategy, max_open_bins=args.open_bins)
        dt = time.perf_counter() - t0
        mode = "stream" if strategy in STREAM_STRATEGIES else "offline"
        print(
            f"{strategy:<10} {mode:<8} {len(packs):>8} {packs.stats.fill_ratio:>8.3%} {args.n / dt:>12,.0f}"
        )

    # Exact resume: snapshot after pack 10, restore into a new packer, feed the rest.
    items = lengths.tolist()
    packer = StreamPacker(args.capacity, "first_fit", args.open_bins)
    stream = packer.pack(items)
    head = [next(stream) for _ in range(10)]
    state = json.loads(json.dumps(packer.state_dict()))  # plain data
    stream.close()
    resumed = StreamPacker(args.capacity, "first_fit", args.open_bins)
    resumed.load_state_dict(state)
    tail = list(resumed.pack(items[state["consumed"] :]))
    whole = list(StreamPacker(args.capacity, "first_fit", args.open_bins).pack(items))
    print(
        f"resume after pack 10 (consumed {state['consumed']}, {len(state['bins'])} open bins): "
        f"{'identical' if head + tail == whole else 'DIFFERENT'} packs ({len(whole)})"
    )

    # One collated row: three tiny samples (prompt tokens unlabelled), padded to a multiple of 8.
    samples = []
    for i, n in enumerate((5, 3, 4)):
        ids = np.arange(100 * (i + 1), 100 * (i + 1) + n)
        labels = ids.copy()
        labels[:2] = -100  # the prompt
        samples.append({"input_ids": ids, "labels": labels, "length": n})
    row = collate_packed(samples, pad_to_multiple_of=8)
    print("collated row (3 samples, padded to a multiple of 8):")
    for key in ("input_ids", "labels", "shift_labels", "position_ids", "cu_seqlens"):
        print(f"  {key:<13} {row[key].tolist()}")
    print(
        f"  max_seqlen={row['max_seqlen']} num_samples={row['num_samples']} num_loss_tokens={row['num_loss_tokens']}"
    )


if __name__ == "__main__":
    main()
