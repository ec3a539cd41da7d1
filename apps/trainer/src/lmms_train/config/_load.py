"""YAML loading, dotted overrides, typed conversion and validation of a `TrainConfig`.

Hand-written rather than a config library: the schema is three flat dataclasses, and what
matters here (unknown keys with a suggestion, one readable error per problem, YAML loaded
safely) is a few dozen lines; libraries add a dependency and their own error style.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from lmms_train._errors import ConfigError, suggest
from lmms_train.config._schema import TrainConfig, TrainerArgs

__all__ = ["apply_overrides", "config_from_dict", "config_to_dict", "load_config"]


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    checks: Checks | None = None,
    early: Early | None = None,
) -> TrainConfig:
    """Read a YAML file, apply `key.sub=value` overrides, return a validated `TrainConfig`.

    Every problem of the file is reported at once (one `ConfigError` listing them), including
    those `checks(cfg)` returns (the trainer's registry and file-system checks). `early(problems)`
    sees the config's own problems (keys, types, ranges) before `checks` runs: the CLI shows them
    at once, before the checks import torch and the model code."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} on line {line}): save it as UTF-8"
        ) from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML in {path}: {_one_line(exc)}") from None
    from lmms_train._convert_config import accept_engine

    raw = accept_engine(raw, path)  # lmms-engine configs: docs/migrating-from-lmms-engine.md
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping with sections, got {type(raw).__name__}"
        )
    raw = apply_overrides(raw, overrides)
    return config_from_dict(raw, checks=checks, early=early)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set `a.b.c=value` into a nested dict; values are parsed as YAML scalars/flow values."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: bad value: {_one_line(exc)}") from None
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return raw


Checks = Callable[[TrainConfig], list[str]]
Early = Callable[[list[str]], None]

# Problems found so far by the pass in progress (`_collecting`); outside one, `_report` raises.
_PROBLEMS: list[list[str]] = []


@contextlib.contextmanager
def _collecting() -> Iterator[list[str]]:
    """Collect every problem `_report`/`_check` sees inside the block instead of raising."""
    _PROBLEMS.append([])
    try:
        yield _PROBLEMS[-1]
    finally:
        _PROBLEMS.pop()


def _report(message: str) -> None:
    if not _PROBLEMS:
        raise ConfigError(message)
    if message not in _PROBLEMS[-1]:
        _PROBLEMS[-1].append(message)


def config_from_dict(
    raw: Mapping[str, Any], *, checks: Checks | None = None, early: Early | None = None
) -> TrainConfig:
    """Convert a nested dict into a validated `TrainConfig` (errors name the dotted key).

    A key with a bad value keeps its default while the rest is checked, so one `ConfigError`
    lists every problem (`.problems`); `checks(cfg)` adds the caller's own; `early` (if given)
    is called with the config's own problems, if any, before `checks` runs."""
    with _collecting() as problems:
        cfg = _build(TrainConfig, raw, "")
        _validate(cfg)
        if problems and early is not None:
            early(list(problems))
        if checks is not None:  # a bad key kept its default above: its checks still run
            problems.extend(p for p in checks(cfg) if p not in problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        _report(f"{where or 'config'}: expected a mapping, got {data!r}")
        data = {}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in names:
            hint = suggest(key, names) or f"; valid keys: {', '.join(names)}"  # list if no match
            _report(f"unknown key {dotted!r}{hint}")
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], dotted)
        except ConfigError as exc:  # keep the default and go on: all problems in one report
            _report(str(exc))
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(value, a, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, where)
    if origin is Literal:
        if value not in args:
            choices = [str(a) for a in args]
            raise ConfigError(
                f"{where}: {value!r} is not one of {', '.join(choices)}{suggest(str(value), choices)}"
            )
        return value
    if tp is Any:
        return value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _check(cond: bool, message: str) -> None:
    if not cond:
        _report(message)


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that need no model, data or process group (all problems at once)."""
    with _collecting() as problems:
        _validate(cfg)
    if problems:
        raise ConfigError(problems)


def _validate(cfg: TrainConfig) -> None:
    _validate_sources(cfg)
    _validate_optimizer(cfg.trainer_args)
    _validate_run(cfg)
    _validate_ranges(cfg)


def _validate_sources(cfg: TrainConfig) -> None:
    """What is trained on: one model source, the data's path, packing and bad records."""
    m, d, t = cfg.model_config, cfg.dataset_config, cfg.trainer_args
    _check(
        (m.load_from_pretrained_path is None) != (m.load_from_config is None),
        "model_config: set exactly one of load_from_pretrained_path or load_from_config",
    )
    if m.load_from_config is not None:
        _check(
            bool(m.load_from_config.model_type),
            "model_config.load_from_config.model_type is required",
        )
    _check(bool(d.dataset_path), "dataset_config.dataset_path is required")
    _check(d.packing_length > 0, "dataset_config.packing_length must be > 0")
    _check(
        not d.packing or t.use_rmpad,
        "dataset_config.packing: true needs trainer_args.use_rmpad: true "
        "(packed rows are only correct with padding-free varlen attention)",
    )
    _check(d.num_workers >= 0, "dataset_config.num_workers must be >= 0")
    for key, choices in (("bad_record_policy", ("skip", "raise")),):
        value = getattr(d, key)
        _check(
            value in choices,
            f"dataset_config.{key}: {value!r} is not one of {', '.join(choices)}{suggest(value, choices)}",
        )
    _check(
        0 <= d.max_bad_record_ratio <= 1, "dataset_config.max_bad_record_ratio must be in [0, 1]"
    )


def _validate_optimizer(t: TrainerArgs) -> None:
    """Steps, accumulation, learning rates and the optimizers' hyper-parameters."""
    _check(
        t.gradient_accumulation_steps >= 1, "trainer_args.gradient_accumulation_steps must be >= 1"
    )
    _check(
        math.isfinite(t.learning_rate) and t.learning_rate > 0,
        f"trainer_args.learning_rate must be a finite number > 0, got {t.learning_rate!r}",
    )
    _check(
        t.muon_learning_rate is None
        or (math.isfinite(t.muon_learning_rate) and t.muon_learning_rate > 0),
        f"trainer_args.muon_learning_rate must be a finite number > 0, got {t.muon_learning_rate!r}",
    )
    _check(
        math.isfinite(t.weight_decay) and t.weight_decay >= 0,
        f"trainer_args.weight_decay must be a finite number >= 0, got {t.weight_decay!r}",
    )
    for key in ("adam_beta1", "adam_beta2", "muon_momentum"):
        _check(0 <= getattr(t, key) < 1, f"trainer_args.{key} must be in [0, 1)")
    _check(t.adam_epsilon > 0, "trainer_args.adam_epsilon must be > 0")
    _check(t.max_grad_norm >= 0, "trainer_args.max_grad_norm must be >= 0 (0 disables clipping)")
    _check(0 <= t.warmup_ratio < 1, "trainer_args.warmup_ratio must be in [0, 1)")
    _check(0 <= t.min_lr_ratio <= 1, "trainer_args.min_lr_ratio must be in [0, 1]")
    _check(0 < t.wsd_decay_ratio <= 1, "trainer_args.wsd_decay_ratio must be in (0, 1]")
    _check(t.warmup_steps >= 0, "trainer_args.warmup_steps must be >= 0")


def _validate_run(cfg: TrainConfig) -> None:
    """The run's length, parallel degrees, logging, evaluation, checkpoints, profiling and
    memory settings."""
    d, t = cfg.dataset_config, cfg.trainer_args
    _check(
        t.max_steps > 0 or (t.max_steps == -1 and d.num_epochs is not None),
        "trainer_args.max_steps must be > 0 (or -1 with dataset_config.num_epochs: the run ends "
        "after that many passes over the data)",
    )
    _check(t.logging_steps >= 1, "trainer_args.logging_steps must be >= 1")
    _check(t.max_nonfinite_skips >= 1, "trainer_args.max_nonfinite_skips must be >= 1")
    _check(t.eval_batches >= 1, "trainer_args.eval_batches must be >= 1")
    _check(t.sp_ulysses_degree >= 1, "trainer_args.sp_ulysses_degree must be >= 1")
    _check(t.dp_replicate >= 1, "trainer_args.dp_replicate must be >= 1")
    _check(t.save_total_limit >= 1, "trainer_args.save_total_limit must be >= 1")
    _check(
        t.eval_steps >= 0 and t.save_steps >= 0, "trainer_args.eval_steps/save_steps must be >= 0"
    )
    _check(
        t.eval_steps == 0 or d.eval_dataset_path is not None,
        "trainer_args.eval_steps > 0 needs dataset_config.eval_dataset_path",
    )
    sinks = ["console", "wandb", "tensorboard", "jsonl"]
    for s in t.report_to:
        _check(
            s in sinks,
            f"trainer_args.report_to: unknown sink {s!r}{suggest(s, sinks)}; choose from {', '.join(sinks)}",
        )
    _check(t.peak_flops is None or t.peak_flops > 0, "trainer_args.peak_flops must be > 0")
    _check(
        0.0 <= t.memory_media_share <= 1.0,
        f"trainer_args.memory_media_share must be in [0, 1], got {t.memory_media_share!r}",
    )
    _check(
        0.0 <= t.activation_checkpointing_fraction <= 1.0,
        "trainer_args.activation_checkpointing_fraction must be in [0, 1], got "
        f"{t.activation_checkpointing_fraction!r}",
    )
    p = t.profile_steps
    _check(
        not p or (len(p) == 2 and 1 <= p[0] <= p[1]),
        f"trainer_args.profile_steps must be [] or [first, last] with 1 <= first <= last, got {p!r}",
    )
    _check(
        0.0 <= t.vision_activation_checkpointing_fraction <= 1.0,
        "trainer_args.vision_activation_checkpointing_fraction must be in [0, 1], got "
        f"{t.vision_activation_checkpointing_fraction!r}",
    )


def _validate_ranges(cfg: TrainConfig) -> None:
    """The remaining numeric ranges (each value alone): EMA, TP/EP, GC, LoRA, media sizes."""
    m, d, t = cfg.model_config, cfg.dataset_config, cfg.trainer_args
    e = t.ema_decay
    _check(
        e is None or 0 < e < 1, f"trainer_args.ema_decay must be in (0, 1) (e.g. 0.9999), got {e!r}"
    )
    for key in ("tp_degree", "ep_degree"):
        _check(getattr(t, key) >= 1, f"trainer_args.{key} must be >= 1")
    _check(t.gc_full_collect_steps >= 0, "trainer_args.gc_full_collect_steps must be >= 0")
    if m.lora is not None:
        _check(m.lora.rank >= 1, f"model_config.lora.rank must be >= 1, got {m.lora.rank}")
        _check(m.lora.alpha > 0, f"model_config.lora.alpha must be > 0, got {m.lora.alpha}")
        _check(
            0 <= m.lora.dropout < 1,
            f"model_config.lora.dropout must be in [0, 1), got {m.lora.dropout}",
        )
    g = d.generate_synthetic
    if g is not None:
        for key in ("num_samples", "image_size"):
            _check(getattr(g, key) >= 1, f"dataset_config.generate_synthetic.{key} must be >= 1")
    for key in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels",
                "video_max_frames", "prefetch_factor", "max_open_bins"):  # fmt: skip
        _check(getattr(d, key) >= 1, f"dataset_config.{key} must be >= 1, got {getattr(d, key)}")
    _check(d.min_pixels <= d.max_pixels, "dataset_config.min_pixels must be <= max_pixels")
    _check(
        d.video_min_pixels <= d.video_max_pixels,
        "dataset_config.video_min_pixels must be <= video_max_pixels",
    )
    _check(math.isfinite(d.video_fps) and d.video_fps > 0, "dataset_config.video_fps must be > 0")
    for key in ("shuffle_buffer", "min_records_for_ratio"):
        _check(getattr(d, key) >= 0, f"dataset_config.{key} must be >= 0")
    _check(d.num_epochs is None or d.num_epochs >= 1, "dataset_config.num_epochs must be >= 1")


def config_to_dict(cfg: Any) -> Any:
    """A plain nested dict (YAML-dumpable) of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg
