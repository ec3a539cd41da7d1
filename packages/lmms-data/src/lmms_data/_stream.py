"""The per-(rank, worker) stream: readers -> shuffle buffer -> processor -> packer -> batches.

Everything a slot holds between two yielded batches is captured by ``state_dict()`` as plain data
(ints, lists): each source's epoch / unit cursor / position, the RNG state, the shuffle buffer and
the packer's open bins as *record references* ``[source, epoch, unit, pos]`` (with the chunk of a
split document, below). On resume the referenced records are re-read from disk and re-processed
(processing is deterministic), so the state stays a few KB however large the media, and the
resumed slot yields exactly the batches the uninterrupted one would have.

Long documents. A sample longer than ``packing_length`` from a processor that declares
``splits_long_samples`` (text pretraining: tokens, labels and positions only) is split into
consecutive chunks of ``packing_length`` tokens (the last one shorter), each packed as a document
of its own: attention stays inside the chunk and positions restart at 0, as pretraining stacks
that cut a token stream into fixed-length sequences do (Megatron-LM, torchtitan, nanoGPT): the
model never sees a position beyond ``packing_length`` and no token is dropped; the first token of
each later chunk is not predicted from the chunk before it (one target per cut). Any other
sample longer than ``packing_length`` (media cannot be cut) is a ``too_long`` bad record with its
location. The chunks not yet handed to the packer are part of the state (``pending``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from lmms_data._collate import collate_packed_batch
from lmms_data._config import DatasetConfig
from lmms_data._errors import BadRecordError, BadRecordRatioExceeded, BadRecordStats
from lmms_data._readers import Unit, decode_raw, iter_unit, read_at
from lmms_data._records import MEDIA_TYPES, normalise, resolve_media
from lmms_data._registry import DATASET_REGISTRY
from lmms_pack import StreamPacker

Ref = tuple[int, int, int, int]  # (source, epoch, unit, pos)
Key = tuple[int, int, int, int, int]  # (source, epoch, unit, pos, chunk): one sample
# packer items: [*Key, length] or [*Key, length, vision tokens]
_STATE_VERSION = 2
_TOKEN_KEYS = ("input_ids", "labels", "position_ids")  # what a split sample holds besides length


def split_sample(sample: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """A token-only sample cut into consecutive chunks of at most ``size`` tokens, positions
    restarting at 0 in each (see the module docstring)."""
    n = int(sample["length"])
    out = []
    for start in range(0, n, size):
        ids = sample["input_ids"][start : start + size]
        out.append({
            "input_ids": ids,
            "labels": sample["labels"][start : start + size],
            "position_ids": np.arange(len(ids), dtype=np.int64),
            "length": len(ids),
        })  # fmt: skip
    return out


def ref_seed(ref: Ref) -> int:
    """A sample's seed from its record reference ``(source, epoch, unit, pos)`` (splitmix64 of
    the four, 48 bits): the same on any rank, packed with anything, before and after a resume;
    a record seen again in another epoch draws anew."""
    x = 0
    for v in ref:
        x = (x * 0x100000001B3 + int(v) + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
        x ^= x >> 31
    return x >> 16


class _Source:
    """One dataset of the mixture, as seen by one slot: its units for each epoch, in order."""

    def __init__(
        self, idx: int, units: list[Unit], slot: int, n_slots: int, cfg: DatasetConfig
    ) -> None:
        self.idx, self.units, self.slot, self.n_slots, self.cfg = idx, units, slot, n_slots, cfg
        self.epoch, self.k, self.pos, self.ordinal = 0, 0, None, 0
        self._it: Iterator | None = None
        self._order_epoch, self._order = -1, []

    def my_units(self) -> list[int]:
        if self._order_epoch != self.epoch:
            n = len(self.units)
            if self.cfg.shuffle:  # seeded shard-order shuffle, different every epoch
                perm = np.random.default_rng([self.cfg.seed, self.idx, self.epoch]).permutation(n)
            else:
                perm = np.arange(n)
            self._order, self._order_epoch = perm[self.slot :: self.n_slots].tolist(), self.epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        ne = self.cfg.num_epochs
        return (ne is not None and self.epoch >= ne) or not self.my_units()

    def next(self) -> tuple[Ref, Any, str] | None:
        """Next ``(ref, raw record, location)``, or None when this slot's epochs are done."""
        while not self.exhausted:
            u = self.my_units()[self.k]
            unit = self.units[u]
            if self._it is None:
                self._it = iter_unit(unit, self.pos)
            try:
                p, q, raw = next(self._it)
            except StopIteration:
                self._it, self.pos, self.ordinal = None, None, 0
                self.k += 1
                if self.k >= len(self.my_units()):
                    self.epoch, self.k = self.epoch + 1, 0
                continue
            ref = (self.idx, self.epoch, u, p)
            loc = unit.location(p, self.ordinal)
            self.pos, self.ordinal = q, self.ordinal + 1
            return ref, raw, loc
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "k": self.k, "pos": self.pos, "ordinal": self.ordinal}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.epoch, self.k, self.pos, self.ordinal = s["epoch"], s["k"], s["pos"], s["ordinal"]
        self._it = None


class SlotStream:
    """Packed batches of one slot (``slot = dp_rank * num_workers + worker``) of ``n_slots``."""

    def __init__(
        self, cfg: DatasetConfig, sources: list[list[Unit]], processor: Callable[[list], dict],
        *, slot: int, n_slots: int, as_torch: bool = True,
    ) -> None:  # fmt: skip
        self.cfg, self.processor, self.slot, self.as_torch = cfg, processor, slot, as_torch
        self.sources = [_Source(i, u, slot, n_slots, cfg) for i, u in enumerate(sources)]
        if all(not s.my_units() for s in self.sources):
            raise ValueError(
                f"slot {slot} of {n_slots} (dp ranks x workers) got no data: the dataset has fewer "
                "records than slots; use fewer workers"
            )
        w = cfg.mixture_weights or [1.0] * len(sources)
        self.weights = np.asarray(w, dtype=np.float64)
        self.rng = np.random.default_rng([cfg.seed, slot, 0x5EED])
        self.buffer: list[tuple[Ref, Any, str]] = []
        self.samples: dict[Key, dict[str, Any]] = {}
        self.pending: list[list[int]] = []  # items of a split document not yet packed
        self.stats = BadRecordStats()
        self.adapter = DATASET_REGISTRY.get(cfg.dataset_type)
        self.vision_budget = cfg.max_vision_tokens_per_pack
        self.packer = StreamPacker(cfg.packing_length, cfg.packing_strategy, cfg.max_open_bins,
                                   budget_capacity=self.vision_budget)  # fmt: skip
        self.batches = 0

    # ---- records -----------------------------------------------------------------------------
    def _pull(self) -> tuple[Ref, Any, str] | None:
        while True:
            live = [i for i, s in enumerate(self.sources) if not s.exhausted]
            if not live:
                return None
            if len(live) == 1:
                i = live[0]
            else:
                p = self.weights[live] / self.weights[live].sum()
                i = live[int(self.rng.choice(len(live), p=p))]
            got = self.sources[i].next()
            if got is not None:
                return got

    def _records(self) -> Iterator[tuple[Ref, Any, str]]:
        size = self.cfg.shuffle_buffer if self.cfg.shuffle else 0
        while True:
            while len(self.buffer) < max(size, 1):
                got = self._pull()
                if got is None:
                    break
                self.buffer.append(got)
            if not self.buffer:
                return
            i = int(self.rng.integers(len(self.buffer))) if size > 1 else 0
            item = self.buffer[i]
            self.buffer[i] = self.buffer[-1]
            self.buffer.pop()
            yield item

    def _base(self, ref: Ref) -> str:
        if self.cfg.data_folder:
            return self.cfg.data_folder
        return os.path.dirname(os.path.abspath(self.sources[ref[0]].units[ref[2]].file))

    def _sample(self, adapted: dict[str, Any], ref: Ref) -> dict[str, Any]:
        """One adapted chat record -> the processor's sample (media resolved, processor errors
        as bad records)."""
        messages = normalise(adapted)
        base = self._base(ref)
        accepted = getattr(self.processor, "media_types", None)  # None: not declared
        for m in messages:
            for part in m["content"]:
                if part["type"] in MEDIA_TYPES:
                    t = part["type"]
                    if accepted is not None and t not in accepted:
                        raise BadRecordError(
                            "unsupported_media", f"this model's processor cannot take {t} parts"
                        )
                    part[t] = resolve_media(
                        part[t], t, base, allow_absolute=self.cfg.allow_absolute_paths
                    )
        try:
            sample = self.processor(messages)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            if isinstance(e, BadRecordError):
                raise
            # what a processor or tokenizer raises on a record it cannot take (wrong types,
            # odd media): a bad record named by its location, not a crash of every rank
            raise BadRecordError(
                "malformed_record", f"the processor failed: {type(e).__name__}: {e}"
            ) from None
        return sample

    def process(self, ref: Ref, raw: Any, loc: str) -> list[dict[str, Any]]:
        """Raw record -> its samples (one, or the chunks of a split document); raises
        ``BadRecordError`` (with location) for bad input."""
        unit = self.sources[ref[0]].units[ref[2]]
        try:
            rec = decode_raw(unit, ref[3], 0, raw)
            if isinstance(rec, BadRecordError):
                raise rec
            adapted = self.adapter(rec)
            if "pair" in adapted:  # a preference pair: two documents, one sample (same row)
                from lmms_data._preference import pair_sample

                docs = [self._sample(r, ref) for r in adapted["pair"]]
                sample = pair_sample(*docs, adapted.get("ref_logps"))
            else:
                sample = self._sample(adapted, ref)
            if "parts" in sample:  # packed model-side (BAGEL): the sample's own noise seed
                sample["seed"] = ref_seed(ref)
            if self.cfg.packing and sample["length"] > self.cfg.packing_length:
                splits = getattr(self.processor, "splits_long_samples", False)  # declared
                if splits and set(sample) <= {*_TOKEN_KEYS, "length"}:
                    return split_sample(sample, self.cfg.packing_length)
                raise BadRecordError(
                    "too_long",
                    f"{sample['length']} tokens > packing_length {self.cfg.packing_length}",
                )
            return [sample]
        except BadRecordError as e:
            raise e.at(loc) from None

    def _items(self) -> Iterator[list[int]]:
        cfg = self.cfg
        while self.pending:  # chunks of a split document that a resumed state still holds
            yield self.pending.pop(0)
        for ref, raw, loc in self._records():
            self.stats.seen += 1
            try:
                samples = self.process(ref, raw, loc)
            except BadRecordError as e:
                if cfg.bad_record_policy == "raise":
                    raise
                self.stats.add(e)
                if (
                    self.stats.seen >= cfg.min_records_for_ratio
                    and self.stats.num_bad > cfg.max_bad_record_ratio * self.stats.seen
                ):
                    raise BadRecordRatioExceeded(
                        f"slot {self.slot}: bad records exceed max_bad_record_ratio="
                        f"{cfg.max_bad_record_ratio}: {self.stats.summary()}"
                    ) from None
                continue
            for chunk, sample in enumerate(samples):
                self.samples[(*ref, chunk)] = sample
                item = [*ref, chunk, int(sample["length"])]
                if self.vision_budget is not None:  # a sample over the budget takes a whole
                    # pack's vision budget (not an error)
                    item.append(min(int(sample.get("vision_tokens", 0)), self.vision_budget))
                self.pending.append(item)
            while self.pending:
                yield self.pending.pop(0)

    # ---- batches -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.cfg.packing:  # one sample per batch
            for it in self._items():
                self.batches += 1
                yield collate_packed_batch(
                    [self.samples.pop(tuple(it[:5]))], as_torch=self.as_torch
                )
            return
        budget = None if self.vision_budget is None else (lambda it: it[6])
        for pack in self.packer.pack(self._items(), length=lambda it: it[5], budget=budget,
                                     flush=True):  # fmt: skip
            samples = [self.samples.pop(tuple(it[:5])) for it in pack]
            self.batches += 1
            yield collate_packed_batch(samples, as_torch=self.as_torch)

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "slot": self.slot,
            "sources": [s.state_dict() for s in self.sources],
            "rng": self.rng.bit_generator.state,
            "buffer": [[*ref, loc] for ref, _, loc in self.buffer],
            "packer": self.packer.state_dict(),
            "pending": [list(it) for it in self.pending],
            "stats": self.stats.to_dict(),
            "batches": self.batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") == 1:  # before split documents: every item is chunk 0
            state = _upgrade_v1(state)
        if state.get("version") != _STATE_VERSION or state["slot"] != self.slot:
            raise ValueError(
                f"data state is for slot {state.get('slot')} (version {state.get('version')}), "
                f"this is slot {self.slot}: resume with the same dp world size and num_workers"
            )
        for s, st in zip(self.sources, state["sources"], strict=True):
            s.load_state_dict(st)
        self.rng.bit_generator.state = state["rng"]
        self.stats = BadRecordStats.from_dict(state["stats"])
        self.batches = state["batches"]
        self.packer.load_state_dict(state["packer"])
        self.pending = [list(it) for it in state["pending"]]
        keys = [tuple(it[:5]) for b in state["packer"]["bins"] for it in b["items"]]
        keys += [tuple(it[:5]) for it in self.pending]
        bin_refs = list(dict.fromkeys(k[:4] for k in keys))
        buf = [(tuple(e[:4]), e[4]) for e in state["buffer"]]
        raws = self._reread([r for r, _ in buf] + bin_refs)
        self.buffer = [(r, raws[r], loc) for r, loc in buf]
        self.samples = {}
        for r in bin_refs:  # these records were processed fine before: re-process them
            chunks = self.process(r, raws[r], "resume")
            for k in keys:
                if k[:4] == r:
                    self.samples[k] = chunks[k[4]]

    def _reread(self, refs: list[Ref]) -> dict[Ref, Any]:
        by_unit: dict[tuple[int, int], list[int]] = {}
        for src, _, u, pos in refs:
            by_unit.setdefault((src, u), []).append(pos)
        got = {
            key: read_at(self.sources[key[0]].units[key[1]], pos) for key, pos in by_unit.items()
        }
        return {r: got[(r[0], r[2])][r[3]] for r in refs}


def _upgrade_v1(state: dict[str, Any]) -> dict[str, Any]:
    """A version-1 slot state (items ``[*ref, length(, vision)]``) as version 2 (chunk 0)."""
    import copy

    out = copy.deepcopy(state)
    for b in out["packer"]["bins"]:
        b["items"] = [[*it[:4], 0, *it[4:]] for it in b["items"]]
    out["pending"], out["version"] = [], _STATE_VERSION
    return out
