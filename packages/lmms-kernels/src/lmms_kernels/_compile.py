"""Per-block ``torch.compile`` of transformer blocks, as the trainer and the benchmarks apply it.

``compile_blocks(blocks)`` replaces each block's ``forward`` with ``torch.compile(forward)``
(an instance attribute, like activation checkpointing's wrapper; ``remove()`` restores it).
Order, as torchtitan applies it: activation checkpointing first (so the checkpoint sits inside
the compiled region and the compiler sees the recompute), then ``compile_blocks``, then FSDP2's
``fully_shard`` (its hooks run around ``__call__``, outside the compiled forward).

What makes a block compile whole: ``varlen_attention`` is a custom op under compile (no graph
break; ``_attention_ops.py``), and Liger-patched RMSNorm/SwiGLU run their upstream torch code
inside compiled regions (Inductor fuses it, with the residual adds around it; ``_liger.py``).
``dynamic=True``: the token dimension and ``max_seqlen`` ints are symbolic, so a new pack length
does not recompile; hidden sizes still specialise (they meet static parameter shapes). Dynamo's
duck sizing is turned off (process-wide) with it: otherwise two sizes that happen to be equal
in the first traced pack (e.g. the number of segments + 1 and a head dim) share one symbol, and
the first pack where they differ recompiles the block in the middle of training.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "CompileHandle",
    "compile_blocks",
    "compile_counts",
    "describe_new_fa4_kernels",
    "fa4_kernel_keys",
    "fa4_variants",
]


@dataclass(kw_only=True, slots=True)
class CompileHandle:
    """Undo record of ``compile_blocks``; ``remove()`` restores each block's forward."""

    blocks: list[nn.Module] = field(default_factory=list)
    _previous: list[object] = field(default_factory=list)

    def remove(self) -> None:
        for block, previous in zip(self.blocks, self._previous, strict=True):
            del block.forward
            if previous is not None:
                block.forward = previous
        self.blocks.clear()
        self._previous.clear()


def _raise_dynamo_limits(n_blocks: int) -> None:
    """Blocks of one class share a code object: dynamo's per-code cache must hold every
    variant (instances, grad on/off under checkpointing) without falling back to eager."""
    import torch._dynamo

    cfg = torch._dynamo.config
    want = 4 * n_blocks + 8
    for key in ("recompile_limit", "cache_size_limit"):  # name changed in torch 2.7
        if hasattr(cfg, key):
            setattr(cfg, key, max(getattr(cfg, key), want))
    for key in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, key):
            setattr(cfg, key, max(getattr(cfg, key), 4 * want))


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counts (host counters, no device sync): ``graphs`` compiled so far
    (a recompile adds one, so a rise after the first steps is a recompile mid-run) and
    ``graph_breaks``."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def _fa4_caches() -> dict[str, object] | None:
    """FA4's compile caches by the name of the function holding them (forward, backward and
    their helper kernels' entries: a dict, or FA4's JITCache with the dict in ``.cache``), or
    None when FA4's interface is not imported or a cache has a layout this module does not know."""
    interface = sys.modules.get("flash_attn.cute.interface")
    if interface is None:
        return None
    caches = {}
    for name, fn in list(vars(interface).items()):
        cache = getattr(fn, "compile_cache", None) if callable(fn) else None
        if cache is None:
            continue
        entries = getattr(cache, "cache", cache)
        if not hasattr(entries, "__len__") or not hasattr(entries, "keys"):
            return None
        caches[name] = entries
    return caches


def fa4_variants() -> int | None:
    """FA4 kernels this process holds (every compile cache of FA4's interface: forward,
    backward and their helper kernels), or None when FA4's interface is not imported. FA4 picks
    tile, split and scheduler settings from the sizes of each call and compiles each new
    combination on first use (or reads it from its disk cache, which the trainer turns on), so
    a rise mid-run marks a step that paid for one."""
    caches = _fa4_caches()
    return None if caches is None else sum(len(c) for c in caches.values())  # type: ignore[arg-type]


def fa4_kernel_keys() -> dict[str, frozenset] | None:
    """The compile keys FA4 holds, by cache (see :func:`fa4_variants`); None without FA4."""
    caches = _fa4_caches()
    if caches is None:
        return None
    return {name: frozenset(c.keys()) for name, c in caches.items()}  # type: ignore[attr-defined]


def describe_new_fa4_kernels(
    before: dict[str, frozenset], after: dict[str, frozenset]
) -> list[str]:
    """One line per kernel in ``after`` and not in ``before`` (two :func:`fa4_kernel_keys`
    snapshots): its cache and, against the held key of that cache that differs from it in the
    fewest places, those places as ``key[i]: old -> new``. FA4's keys are tuples of settings it
    picked for a call (tiles, flags derived from the call's sizes), so the differing places name
    what a new size changed."""
    lines = []
    for name, keys in after.items():
        held = before.get(name, frozenset())
        for key in sorted(keys - held, key=repr):
            lines.append(f"{name}: {_closest_difference(key, held)}")
    return lines


def _closest_difference(key: object, held: frozenset) -> str:
    same_shape = [
        k for k in held if isinstance(k, tuple) and isinstance(key, tuple) and len(k) == len(key)
    ]
    if not same_shape:
        return f"first kernel of its kind, key {key!r}"
    assert isinstance(key, tuple)

    def differing(k: tuple) -> list[int]:
        return [i for i, (a, b) in enumerate(zip(k, key)) if a != b]

    nearest = min(same_shape, key=lambda k: (len(differing(k)), repr(k)))
    places = ", ".join(f"key[{i}]: {nearest[i]!r} -> {key[i]!r}" for i in differing(nearest))
    return f"new key, {places}"


def _no_duck_sizing() -> None:
    """Give every dynamic size its own symbol instead of unifying sizes equal at first trace."""
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "use_duck_shape"):
        fx_config.use_duck_shape = False


def compile_blocks(
    blocks: Sequence[nn.Module],
    *,
    backend: str = "inductor",
    dynamic: bool | None = True,
    fullgraph: bool = False,
) -> CompileHandle:
    """``torch.compile`` the forward of each block (after AC, before FSDP); see module doc.

    ``backend="aot_eager"`` traces and runs AOTAutograd without Inductor (tests, debugging).
    ``fullgraph=True`` makes any graph break an error instead of a silent split.
    Raises dynamo's recompile limits so that all blocks fit and, with ``dynamic=True``, turns
    off duck sizing (process-wide settings; see the module doc).
    """
    handle = CompileHandle()
    if not blocks:
        return handle
    _raise_dynamo_limits(len(blocks))
    if dynamic:
        _no_duck_sizing()
    for block in blocks:
        previous = block.__dict__.get("forward")  # e.g. the activation-checkpoint wrapper
        block.forward = torch.compile(
            block.forward, backend=backend, dynamic=dynamic, fullgraph=fullgraph
        )
        handle.blocks.append(block)
        handle._previous.append(previous)
    return handle
