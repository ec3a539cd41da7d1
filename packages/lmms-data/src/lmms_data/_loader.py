"""``build_dataloader``: a resumable multi-worker loader of packed batches for one DP rank.

Work is split by *slot* = ``dp_rank * num_workers + worker``: each slot reads only its own units
(see ``_readers``), so no process reads another's data. Workers run in a torch ``DataLoader``
(which hands out batches round-robin over workers); each batch travels with its slot's state
snapshot taken right after it was made, and the loader keeps the snapshot of the last batch it
*returned* per worker plus which worker is next. ``state_dict()`` is therefore exact even with
prefetching; on resume, worker ``w`` restarts as logical worker ``(w + next) % num_workers`` so the
round-robin continues where it stopped. (torchdata's StatefulDataLoader does the same bookkeeping
but is not installed here; this is ~80 lines with no extra dependency.)

A rank whose records are bad keeps yielding (bad records are skipped and counted), so it never
stalls its peers in a collective. With ``num_epochs`` set, ranks may run out at different steps:
train with ``max_steps`` and infinite iteration (the default) to avoid that.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from lmms_data._balance import VisionBalancer
from lmms_data._config import DatasetConfig
from lmms_data._errors import BadRecordError, BadRecordStats, logger
from lmms_data._readers import Unit, discover_units, list_files, unreadable_reason
from lmms_data._registry import PROCESSOR_REGISTRY
from lmms_data._remote import file_size, is_url, remote_names
from lmms_data._shape import check_shape
from lmms_data._stream import SlotStream

_STATE_VERSION = 1


def build_processor(
    family: str, processor: Any, config: DatasetConfig | None = None, **kwargs: Any
):
    """Registered processor ``family`` around an HF processor (object or local folder path)."""
    cfg = config or DatasetConfig()
    opts = dict(
        min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, video_min_pixels=cfg.video_min_pixels,
        video_max_pixels=cfg.video_max_pixels, video_fps=cfg.video_fps, video_max_frames=cfg.video_max_frames,
    )  # fmt: skip
    opts.update(cfg.extra)
    opts.update(kwargs)
    return PROCESSOR_REGISTRY.get(family)(processor, **opts)


def discover(cfg: DatasetConfig, n_slots: int) -> list[list[Unit]]:
    """Every source's units. An unreadable Parquet/Arrow file stops here under
    ``bad_record_policy: raise``; under ``skip`` it is named now and counted when reached."""
    sources = [discover_units(p, cfg.dataset_format, n_slots) for p in cfg.paths]
    for file in sorted({u.file for units in sources for u in units if u.fmt == "corrupt"}):
        reason = unreadable_reason(file, "parquet" if file.endswith(".parquet") else "arrow")
        if cfg.bad_record_policy == "raise":
            raise BadRecordError("corrupt_file", f"unreadable file: {reason}", file)
        logger.warning("skipping unreadable file %s: %s", file, reason)
    check_shape(cfg, sources)  # one line naming the accepted shapes, not N bad records later
    return sources


class DatasetChangedError(ValueError):
    """The dataset files differ from those a loader state was saved with."""


def dataset_fingerprint(cfg: DatasetConfig) -> list[list[list[Any]]]:
    """Per ``dataset_path`` entry, ``[name, size]`` of each file (names relative to the entry,
    so a moved dataset keeps its fingerprint). Sizes, not contents: cheap for any dataset; an
    edit that keeps a file's size is not seen."""
    out = []
    for path in cfg.paths:
        files = [f for f, _ in list_files(path, cfg.dataset_format)]
        if is_url(path):
            out.append([[n, file_size(f)] for n, f in zip(remote_names(path, files), files)])
            continue
        base = path if os.path.isdir(path) else os.path.dirname(os.path.commonpath(files))
        out.append([[os.path.relpath(f, base), file_size(f)] for f in files])
    return out


def _fingerprint_changes(old: list, new: list) -> str:
    """``"a.parquet: 1200 -> 1100 bytes; 1 file(s) added (e.g. b.parquet)"``, for the first
    source that differs."""
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a == b:
            continue
        was, now = dict(map(tuple, a)), dict(map(tuple, b))
        parts = [f"{f}: {was[f]} -> {now[f]} bytes" for f in was if f in now and was[f] != now[f]]
        for label, names in (("added", now.keys() - was), ("removed", was.keys() - now)):
            if names:
                parts.append(f"{len(names)} file(s) {label} (e.g. {sorted(names)[0]})")
        where = f"dataset_path[{i}]" if len(new) > 1 else "the dataset files"
        return f"{where} changed: {'; '.join(parts[:3])}"
    return f"the dataset has {len(new)} path(s), the saved state {len(old)}"


def _is_hf_processor(p: Any) -> bool:
    if isinstance(p, str | os.PathLike):
        return True
    tf = sys.modules.get("transformers")  # not imported -> p cannot be an HF processor
    return tf is not None and isinstance(p, tf.ProcessorMixin)


def _identity(x: Any) -> Any:
    return x


def _worker_init(_: int) -> None:
    import torch

    torch.set_num_threads(1)


class _SlotsDataset:
    """IterableDataset body: each worker builds its SlotStream (logical id rotated on resume)."""

    def __init__(self, loader: PackedLoader) -> None:
        self.cfg, self.units, self.processor = loader.cfg, loader.units, loader.processor
        self.dp_rank, self.W, self.n_slots = loader.dp_rank, loader.W, loader.n_slots
        self.rotation = loader._next
        self.states = copy.deepcopy(loader._states)

    def __iter__(self) -> Iterator[tuple[dict, dict, int]]:
        import torch.utils.data as tud

        info = tud.get_worker_info()
        phys = info.id if info is not None else 0
        logical = (phys + self.rotation) % self.W
        stream = SlotStream(self.cfg, self.units, self.processor,
                            slot=self.dp_rank * self.W + logical, n_slots=self.n_slots)  # fmt: skip
        if self.states.get(logical) is not None:
            stream.load_state_dict(self.states[logical])
        for batch in stream:
            yield batch, stream.state_dict(), logical


class PackedLoader:
    """Iterable of packed batches (docs/contracts.md) for one DP rank, with exact resume.

    ``iter()`` always continues after the last batch returned (a fresh loader, or one given
    ``load_state_dict``, starts there too). ``metrics()`` sums the bad-record counters.
    """

    def __init__(
        self, cfg: DatasetConfig, processor: Any, *, dp_rank: int = 0, dp_world: int = 1,
        num_workers: int | None = None, seed: int | None = None,
        vision_cost: Callable[[dict[str, Any]], float] | None = None,
    ) -> None:  # fmt: skip
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_world})")
        if seed is not None and seed != cfg.seed:
            cfg = copy.copy(cfg)
            cfg.seed = seed
        self.cfg = cfg
        self.num_workers = cfg.num_workers if num_workers is None else num_workers
        self.W = max(1, self.num_workers)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.n_slots = dp_world * self.W
        if processor is None:
            if not cfg.processor_path:
                raise ValueError("no processor given and dataset_config.processor_path is not set")
            processor = cfg.processor_path
        if _is_hf_processor(processor):
            processor = build_processor(
                cfg.processor_family,
                str(processor) if isinstance(processor, os.PathLike) else processor,
                cfg,
            )
        self.processor = processor
        self.units = discover(cfg, self.n_slots)
        self.fingerprint = dataset_fingerprint(cfg)
        self._states: dict[int, dict] = {}
        self._next = 0
        # packs reordered in a look-ahead window so DP ranks' vision FLOPs per step stay close
        self._balancer = (
            VisionBalancer(cfg.vision_balance_window, vision_cost)
            if cfg.vision_balance_window
            else None
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        ds = _SlotsDataset(self)
        if self.num_workers == 0:
            it: Iterator = iter(ds)
        else:
            import torch.utils.data as tud

            class _DS(tud.IterableDataset):
                def __iter__(self_inner):
                    return iter(ds)

            it = iter(tud.DataLoader(
                _DS(), batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                prefetch_factor=self.cfg.prefetch_factor, worker_init_fn=_worker_init,
            ))  # fmt: skip
        if self._balancer is not None:
            yield from self._balanced(it)
            return
        for batch, state, logical in it:
            self._states[logical] = state
            self._next = (logical + 1) % self.W
            yield batch

    def _balanced(self, it: Iterator[tuple[dict, dict, int]]) -> Iterator[dict[str, Any]]:
        """Packs through the balancer's window; the saved stream states stay those just before
        the window's first pack, so a resume re-produces the window (see lmms_data._balance)."""
        bal = self._balancer
        assert bal is not None
        bal.load_state_dict(bal.state_dict())  # a new iter() re-produces the current window
        done = False
        while True:
            e = bal.pop(draining=done)
            if e is None:
                if done:
                    return
                nxt = next(it, None)
                if nxt is None:
                    done = True
                else:
                    bal.push(nxt[0], nxt)
                continue
            for g in bal.advance():
                _, state, logical = g.item
                self._states[logical] = state
                self._next = (logical + 1) % self.W
            yield e.item[0]

    def set_vision_cost(self, cost: Callable[[dict[str, Any]], float]) -> None:
        """The pack cost ``vision_balance_window`` orders by (the trainer passes its family's
        ``pack_vision_flops`` once the model config is known); no effect when balancing is off."""
        if self._balancer is not None:
            self._balancer.cost = cost

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "dp_rank": self.dp_rank,
            "dp_world": self.dp_world,
            "num_workers": self.W,
            "next_worker": self._next,
            "workers": {str(k): v for k, v in self._states.items()},
            "fingerprint": self.fingerprint,
            **({"balance": self._balancer.state_dict()} if self._balancer is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.dp_rank, self.dp_world, self.W)
        theirs = (state.get("dp_rank"), state.get("dp_world"), state.get("num_workers"))
        if state.get("version") != _STATE_VERSION or mine != theirs:
            raise ValueError(
                f"data state saved for (dp_rank, dp_world, num_workers)={theirs}, loader has {mine}: "
                "resume with the same layout"
            )
        saved = state.get("fingerprint")  # absent in states written before it was recorded
        if saved is not None and saved != self.fingerprint:
            raise DatasetChangedError(_fingerprint_changes(saved, self.fingerprint))
        if (state.get("balance") is None) != (self._balancer is None):
            raise ValueError(
                "data state saved with a different dataset_config.vision_balance_window "
                "(on vs off): resume with the same setting"
            )
        self._states = {int(k): v for k, v in state["workers"].items()}
        self._next = state["next_worker"]
        if self._balancer is not None:
            self._balancer.load_state_dict(state["balance"])

    def metrics(self) -> dict[str, int]:
        """``{"records_seen", "records_bad", "bad/<reason>": n, ...}`` over returned batches."""
        total = BadRecordStats()
        for st in self._states.values():
            s = BadRecordStats.from_dict(st["stats"])
            total.seen += s.seen
            for k, v in s.bad.items():
                total.bad[k] = total.bad.get(k, 0) + v
        out = {"records_seen": total.seen, "records_bad": total.num_bad}
        out.update({f"bad/{k}": v for k, v in sorted(total.bad.items())})
        return out


def build_dataloader(
    dataset_config: DatasetConfig | dict,
    processor: Any,
    dp_rank: int = 0,
    dp_world: int = 1,
    num_workers: int | None = None,
    seed: int | None = None,
    vision_cost: Callable[[dict[str, Any]], float] | None = None,
) -> PackedLoader:
    """The trainer's entry point: packed batches for ``dp_rank`` with ``state_dict()`` resume.

    ``processor`` is an lmms processor (any ``callable(messages) -> sample``), an HF processor, or
    a local folder path; ``None`` uses ``processor_path`` from the config. ``vision_cost(batch)``
    estimates a pack's vision FLOPs for ``vision_balance_window`` (default: its patch count).
    """
    cfg = (
        DatasetConfig.from_dict(dataset_config)
        if isinstance(dataset_config, dict)
        else dataset_config
    )
    return PackedLoader(cfg, processor, dp_rank=dp_rank, dp_world=dp_world,
                        num_workers=num_workers, seed=seed, vision_cost=vision_cost)  # fmt: skip


#: the name docs/contracts.md uses; same function
build_dataset = build_dataloader
