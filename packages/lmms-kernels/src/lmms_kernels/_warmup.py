"""Compile the attention kernels a run will need before its first step.

FA4 (``flash_attn.cute``) compiles a kernel per combination of settings it derives from each
call's sizes, on first use. One such switch is the number of sequences in a varlen call: above
256 its tile scheduler takes a cumulative-tile table (binary batch search), a different compiled
kernel. In a VL step the vision tower's window attention has one sequence per window (~16k
patches / 64 per window: ~256), so the first pack whose window count falls on the other side of
256 from the packs before it pays for two new kernels mid-run (a 5-9 s step on a cold cache,
step 13 of every cold VL run measured so far: benchmarks/models/NOTES.md, item 27).

:func:`warm_attention` replays every attention signature this process has called (heads, head
dims, dtype, causal, scale, backend, and whether it ran as the compiled custom op or eagerly:
``_attention.CALLS``) forward and backward on synthetic packs of ``counts`` segments, so each
size-picked variant compiles (or loads from FA4's disk cache) at start-up. The trainer calls it
after its warm-up forward/backward of the first pack (``trainer_args.compile_warmup``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _attention as _A

__all__ = ["WARM_COUNTS", "attention_calls", "warm_attention"]

#: Segment counts replayed by default: one sequence, and either side of FA4's varlen batch
#: threshold (``BIN_BATCH_SEARCH_THRESH = 256`` in flash-attn-4 4.0.0b36).
WARM_COUNTS = (1, 255, 257)


def attention_calls() -> list[tuple]:
    """The distinct attention signatures called so far in this process (see module doc)."""
    return list(_A.CALLS)


def warm_attention(
    counts: Sequence[int] = WARM_COUNTS,
    *,
    seg_len: int = 64,
    backends: Sequence[str] | None = ("fa4",),
    calls: Sequence[tuple] | None = None,
) -> int:
    """Forward and backward of every recorded call signature (or ``calls``) on ``n`` segments
    of ``seg_len`` tokens for each ``n`` in ``counts``; returns the number of replays.

    ``backends``: only signatures of these backends (default FA4, the one that picks compiled
    variants from sizes; None: all, e.g. for tests on CPU). The inputs are random, the outputs
    and gradients discarded; nothing is read back on the host beyond what the backend itself
    reads. The replay adds signatures of its own to the record only where they already were.
    """
    done = 0
    for sig in list(_A.CALLS) if calls is None else calls:
        path, name, hq, hkv, d, dv, dtype, causal, scale, device = sig
        if backends is not None and name not in backends:
            continue
        for n in counts:
            t = n * seg_len
            q, k, v = (
                torch.randn(t, h, dim, dtype=dtype, device=device, requires_grad=True)
                for h, dim in ((hq, d), (hkv, d), (hkv, dv))
            )
            cu = torch.arange(0, t + 1, seg_len, dtype=torch.int32, device=device)  # [n+1]
            if path == "op":
                out, _ = torch.ops.lmms_kernels.varlen_attn(
                    q, k, v, cu, cu, seg_len, seg_len, causal, scale, name
                )
            else:
                out = _A._run_backend(name, q, k, v, cu, cu, seg_len, seg_len, causal, scale)
            out.float().sum().backward()
            done += 1
    return done
