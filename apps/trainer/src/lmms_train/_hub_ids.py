"""Hub ids in a config, resolved once before anything reads them (docs/weights.md).

`resolve_config_hub_ids(cfg)` replaces every Hugging Face Hub id (``org/name[@revision]``) among
the model, tokenizer/processor and dataset paths of a config by the local snapshot folder of the
standard cache (`lmms_data.resolve_hub_path`: downloads once per node, offline reads the cache);
the rest of the trainer then reads local folders as before. It runs first in the preflight
(`_preflight.config_problems`) and in the subcommands that read a config without training
(`check-data`; `plan` without weights or data: it builds the model on meta and reads no data).
"""

from __future__ import annotations

from typing import Any

from lmms_train._errors import ConfigError, UserError
from lmms_train.config import TrainConfig

__all__ = ["raise_hub_problems", "resolve_config_hub_ids", "resolve_path_arg"]

_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".feather", ".ipc", ".gz")


def _one(value: Any, key: str, kind: str, problems: list[str]) -> Any:
    from lmms_data import HubError, is_hub_id, resolve_hub_path

    if not isinstance(value, str) or not is_hub_id(value):
        return value
    if kind == "dataset" and value.lower().endswith(_DATA_SUFFIXES):
        return value  # a data file's path (missing: the preflight says so), not a repo
    try:
        return resolve_hub_path(value, kind=kind)
    except HubError as exc:
        problems.append(f"{key}: {exc}")
        return value


def _resolve(obj: Any, attr: str, key: str, kind: str, problems: list[str]) -> None:
    value = getattr(obj, attr)
    if isinstance(value, list):
        value = [_one(v, f"{key}[{i}]", kind, problems) for i, v in enumerate(value)]
    else:
        value = _one(value, key, kind, problems)
    setattr(obj, attr, value)


def resolve_config_hub_ids(
    cfg: TrainConfig, *, weights: bool = True, datasets: bool = True
) -> list[str]:
    """Resolve the config's Hub ids in place to local cache folders; one line per id that
    cannot be resolved (not cached while offline, unknown repo, ...). `weights=False`: the
    model's configs and tokenizer files only (what `plan` reads: the model is built on meta);
    `datasets=False`: the data paths stay as written."""
    m, d = cfg.model_config, cfg.dataset_config
    problems: list[str] = []
    _resolve(m, "load_from_pretrained_path", "model_config.load_from_pretrained_path",
             "model" if weights else "processor", problems)  # fmt: skip
    if not m.build_local_processor:  # a folder to build into, never a Hub id
        _resolve(m, "processor_path", "model_config.processor_path", "processor", problems)
        _resolve(d, "processor_path", "dataset_config.processor_path", "processor", problems)
    generated = d.dataset_path if d.generate_synthetic is not None else None
    for attr in ("dataset_path", "eval_dataset_path") if datasets else ():
        if getattr(d, attr) != generated:  # a folder the demo data is generated into
            _resolve(d, attr, f"dataset_config.{attr}", "dataset", problems)
    return problems


def resolve_path_arg(value: str | None, kind: str, what: str) -> str | None:
    """A command-line folder argument (`sample`, `render`): a Hub id becomes its cache folder."""
    if value is None:
        return None
    from lmms_data import HubError, resolve_hub_path

    try:
        return resolve_hub_path(value, kind=kind)
    except HubError as exc:
        raise UserError(f"{what}: {exc}") from None


def raise_hub_problems(cfg: TrainConfig, *, weights: bool = True, datasets: bool = True) -> None:
    """`resolve_config_hub_ids` for commands without a preflight: problems raise one report."""
    problems = resolve_config_hub_ids(cfg, weights=weights, datasets=datasets)
    if problems:
        raise ConfigError(problems)
