"""The data plan interface of the trainer: `DataSource`, one implementation per
`lmms_models.DataPlan` class (`_token_data`: token rows and rows a family packs itself;
`_latent_data`: latent batches), and what they share: the `dataset_config` section as
lmms_data's `DatasetConfig`, and `TrainData`, the resumable training stream with clear data errors.

lmms-models may not import lmms-data (DESIGN.md, "Dependencies flow one way"): a family's spec
*describes* its plan (`ModelSpec.data_plan`), the trainer builds it from lmms_data's loaders.
`build_data` and `lmms-train check-data` call only this interface (docs/contracts.md, "Data plans").
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import re
from collections.abc import Callable
from typing import Any

from lmms_train._dist import DistEnv
from lmms_train._errors import ConfigError, DataChangedError, UserError
from lmms_train.config import TrainConfig, config_to_dict

__all__ = ["DataSource", "TrainData", "data_config", "path_exists", "processor_path"]

TRAINER_KEYS = ("eval_dataset_path", "generate_synthetic")


def processor_path(cfg: TrainConfig) -> str | None:
    m = cfg.model_config
    return cfg.dataset_config.processor_path or m.processor_path or m.load_from_pretrained_path


def path_exists(path: str | list[str]) -> bool:
    paths = [path] if isinstance(path, str) else path
    from lmms_data import dataset_path_exists  # a glob as lmms-data expands it; URLs too

    return all(dataset_path_exists(p) for p in paths)


def data_config(cfg: TrainConfig, spec: Any, **overrides: Any) -> Any:
    """`lmms_data.DatasetConfig` from the trainer's `dataset_config` section."""
    from lmms_data import DatasetConfig

    raw = {k: v for k, v in config_to_dict(cfg.dataset_config).items() if k not in TRAINER_KEYS}
    raw["processor_family"] = raw["processor_family"] or spec.processor_family
    raw["processor_path"] = processor_path(cfg)
    raw.update(overrides)
    known = {f.name for f in dataclasses.fields(DatasetConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:  # the trainer's schema is ahead of lmms_data's: say so instead of dropping keys
        raise ConfigError(
            f"dataset_config: keys {unknown} are not understood by this lmms_data version"
        )
    try:
        return DatasetConfig.from_dict(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"dataset_config: {exc}") from exc


def _unwrap(exc: BaseException) -> tuple[str, str]:
    """`(type name, message)` of a data error, also when a DataLoader worker raised it (torch
    re-raises it in the main process as its traceback text)."""
    text = str(exc)
    if "in DataLoader worker process" not in text:
        return type(exc).__name__, text
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^([\w.]+): (.*)$", lines[i])
        if m and not lines[i].startswith(("Caught ", "Original ")):
            return m.group(1).rsplit(".", 1)[-1], "\n".join([m.group(2), *lines[i + 1 :]])
    return type(exc).__name__, text


class TrainData:
    """The training stream for this rank: packed batches, resumable, with clear data errors.
    `finish(batch)`: the family's last packing step on the host (a model-side packer: rows of
    parts -> the packed row, `spec.finish_pack`); stateless, so the loader's state stays the
    resume point."""

    def __init__(
        self, loader: Any, finish: Any = None, *, until_exhausted: bool = False,
        vision_cost: Callable[[Callable[[dict[str, Any]], float]], None] | None = None,
    ) -> None:  # fmt: skip
        self.loader, self.finish = loader, finish
        self.until_exhausted = until_exhausted  # max_steps: -1: the run ends with the data
        self._vision_cost = vision_cost  # the loader's setter where it balances vision work

    def set_vision_cost(self, cost: Callable[[dict[str, Any]], float]) -> None:
        """The pack cost the loader's vision balancing (`vision_balance_window`) orders by, known
        once the model config is; no effect where the data source does not balance."""
        if self._vision_cost is not None:
            self._vision_cost(cost)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                if self.until_exhausted:
                    return
                raise UserError(
                    "the training data ran out before max_steps (set dataset_config.num_epochs: null)"
                ) from None
            except (ValueError, RuntimeError) as exc:
                name, text = _unwrap(exc)
                if name in ("BadRecordRatioExceeded", "BadRecordError"):
                    lines = text.splitlines()
                    example = next((ln.strip() for ln in lines[1:] if ln.strip()), "")
                    head = lines[0].removesuffix("; last examples:")
                    see = (
                        "raise dataset_config.packing_length or shorten the samples; "
                        if "too_long" in head
                        else ""
                    )
                    raise UserError(
                        f"{head}{'; e.g. ' + example if example else ''} ({see}see dataset_config"
                        ".bad_record_policy / max_bad_record_ratio / packing_length)"
                    ) from None
                msg = str(exc)
                if "saved with a different config" in msg:  # a resumed position of other packing
                    raise DataChangedError(
                        f"the checkpoint's data position does not fit this data config: {msg} "
                        "(resume with the dataset_config it was written with)"
                    ) from None
                if "longer than" in msg or "overlong" in msg or "capacity" in msg:
                    raise UserError(
                        f"a sample does not fit dataset_config.packing_length: {msg} "
                        "(raise packing_length or shorten the samples)"
                    ) from None
                raise
            if self.finish is not None:
                try:
                    batch = self.finish(batch)
                except ValueError as exc:
                    raise ConfigError(f"dataset_config: {exc}") from None
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from lmms_data import DatasetChangedError

        try:
            self.loader.load_state_dict(state)
        except DatasetChangedError as exc:
            raise DataChangedError(str(exc)) from None

    def bad_records(self) -> int:
        return int(self.loader.metrics().get("records_bad", 0))

    def passes_done(self) -> int:
        """Passes over the data this rank's loader has finished (the fewest of its workers'
        and sources'; 0 until every worker has made a batch)."""
        state = self.loader.state_dict()
        workers = state.get("workers", {})
        if len(workers) < max(1, int(state.get("num_workers") or 1)):
            return 0
        epochs = [s["epoch"] for w in workers.values() for s in w.get("sources", [])]
        return min(epochs, default=0)


class DataSource(abc.ABC):
    """What the trainer asks of a family's data plan (`plan`: the spec's `lmms_models.DataPlan`).

    * `train()`: this rank's resumable training stream; `eval_rows()`: a callable giving the
      validation rows (None without `eval_dataset_path` or `eval_steps`);
    * `check(num_records)`: what `lmms-train check-data` reports (a `DataReport`).

    An implementation gives `loader(dcfg)` (this rank's resumable loader of a `DatasetConfig`),
    `check_inputs(dcfg)` and `check`; `finish` is the host-side last step on each row (None:
    the loader's rows are the rows; stateless, so the loader's state stays the resume point).
    """

    finish: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    #: whether `loader(dcfg)` orders packs by vision cost (lmms-data's `set_vision_cost`)
    balances_vision: bool = False

    def __init__(self, cfg: TrainConfig, spec: Any, plan: Any, env: DistEnv) -> None:
        self.cfg, self.spec, self.plan, self.env = cfg, spec, plan, env

    def dataset_config(self, **overrides: Any) -> Any:
        """The run's `DatasetConfig` (with `overrides`)."""
        return data_config(self.cfg, self.spec, **overrides)

    def check_inputs(self, dcfg: Any) -> None:
        """Raise a UserError / ConfigError naming what is missing before any record is read."""
        if not path_exists(dcfg.dataset_path):
            raise UserError(f"dataset_config.dataset_path: {dcfg.dataset_path!r} does not exist")

    @abc.abstractmethod
    def loader(self, dcfg: Any) -> Any:
        """This rank's resumable loader of `dcfg` (`iter`, `state_dict`, `load_state_dict`,
        `metrics`)."""

    @abc.abstractmethod
    def check(self, num_records: int) -> Any:
        """The `DataReport` of the first `num_records` records (`lmms-train check-data`)."""

    def train(self) -> TrainData:
        dcfg = self.dataset_config()
        self.check_inputs(dcfg)
        until_exhausted = self.cfg.trainer_args.max_steps < 0  # the run ends with the data
        loader = self.loader(dcfg)
        setter = loader.set_vision_cost if self.balances_vision else None
        return TrainData(loader, self.finish, until_exhausted=until_exhausted, vision_cost=setter)

    def eval_rows(self) -> Callable[[], list[dict[str, Any]]] | None:
        d, t = self.cfg.dataset_config, self.cfg.trainer_args
        if d.eval_dataset_path is None or t.eval_steps <= 0:
            return None
        ecfg = self.dataset_config(dataset_path=d.eval_dataset_path, shuffle=False, num_workers=0)

        def rows() -> list[dict[str, Any]]:
            fresh = TrainData(self.loader(ecfg), self.finish)
            return list(itertools.islice(iter(fresh), t.eval_batches))

        return rows
