"""Checks before the expensive part, and the output folder's lock.

`config_problems(cfg)` finds, without building a model or reading data, every problem the config
and the file system already show: unregistered names (model family, dataset type and format,
processor, packing strategy, attention and loss backends), GPU-only switches on a CPU run, missing
dataset/processor paths, an output folder that is a file or cannot be written, a resume target
that is not a checkpoint. The CLI merges them with the config's own problems into one report.

`RunLock` makes an output folder hold one run at a time: an exclusive `flock` on
`<output_dir>/.lmms-train.lock`, held by rank 0 for the whole run. The kernel drops it when the
process ends however it ends (kill -9 included), so a crashed run never leaves it stuck.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from lmms_train._errors import ConfigError, UserError, suggest
from lmms_train.config import TrainConfig, config_to_dict

__all__ = ["RunLock", "config_differences", "config_problems"]

LOCK_NAME = ".lmms-train.lock"
_GPU_ATTENTION = ("fa4", "fa", "torch")  # varlen kernels with no CPU implementation
_LOSS_BACKENDS = ("auto", "liger", "torch", "triton")


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every problem visible before the model is built (empty list: none found)."""
    from lmms_train._hub_ids import resolve_config_hub_ids

    problems = resolve_config_hub_ids(cfg)  # Hub ids -> local cache folders, before any read
    if problems:  # an id that did not resolve: the checks below would only repeat it
        return problems
    spec = _spec_problems(cfg, problems)
    _name_problems(cfg, spec, problems)
    if spec is not None:
        from lmms_train._model_checks import model_problems

        problems.extend(p for p in model_problems(cfg, spec) if p not in problems)
    _device_problems(cfg, problems)
    _path_problems(cfg, problems)
    _output_problems(cfg, problems)
    return problems


def _spec_problems(cfg: TrainConfig, problems: list[str]) -> Any:
    from lmms_train._model_setup import resolve_spec

    try:
        return resolve_spec(cfg)
    except UserError as exc:
        problems.append(str(exc))
        return None


def _name_problems(cfg: TrainConfig, spec: Any, problems: list[str]) -> None:
    from lmms_data import DATASET_REGISTRY, PROCESSOR_REGISTRY, SYNTHETIC_KINDS
    from lmms_kernels import BACKENDS
    from lmms_models import GeneratesLatents
    from lmms_pack import STREAM_STRATEGIES

    d, t = cfg.dataset_config, cfg.trainer_args
    checks = [
        ("dataset_config.dataset_type", d.dataset_type, list(DATASET_REGISTRY.names())),
        ("dataset_config.packing_strategy", d.packing_strategy, list(STREAM_STRATEGIES)),
        ("trainer_args.attn_backend", t.attn_backend, ["auto", *BACKENDS]),
        ("trainer_args.loss_backend", t.loss_backend, list(_LOSS_BACKENDS)),
    ]
    if d.generate_synthetic is not None and d.generate_synthetic.kind is not None:
        kinds = SYNTHETIC_KINDS.names()
        checks.append(("dataset_config.generate_synthetic.kind", d.generate_synthetic.kind, kinds))
    if t.vision_attn_backend is not None:
        vision = ["auto", *BACKENDS]
        checks.append(("trainer_args.vision_attn_backend", t.vision_attn_backend, vision))
    family = d.processor_family or (spec.processor_family if spec is not None else None)
    if family is not None and not isinstance(spec, GeneratesLatents):
        checks.append(("dataset_config.processor_family", family, list(PROCESSOR_REGISTRY.names())))
    for key, value, names in checks:
        if value not in names:
            problems.append(
                f"{key}: {value!r} is not registered{suggest(value, names)}; "
                f"choose from {', '.join(names)}"
            )
    if spec is not None:
        from lmms_train._data_setup import data_config

        try:  # lmms_data's own checks (formats, mixture weights, ...), on the keys not
            # already reported above (each problem once)
            data_config(cfg, spec, **_reported_data_defaults(problems + _own_problems(cfg)))
        except ConfigError as exc:
            problems.extend(p for p in exc.problems if p not in problems)


def _own_problems(cfg: TrainConfig) -> list[str]:
    """The config's own problems (`lmms_train.config.validate`): reported by the caller."""
    from lmms_train.config._load import validate

    try:
        validate(cfg)
    except ConfigError as exc:
        return exc.problems
    return []


def _reported_data_defaults(problems: list[str]) -> dict[str, Any]:
    """lmms_data's defaults of the dataset_config keys that `problems` already name."""
    import dataclasses

    from lmms_data import DatasetConfig

    out = {}
    for f in dataclasses.fields(DatasetConfig):
        named = any(p.startswith(f"dataset_config.{f.name}") for p in problems)
        if named and f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _device_problems(cfg: TrainConfig, problems: list[str]) -> None:
    """GPU-only switches on a run that will be on the CPU."""
    t = cfg.trainer_args
    cuda = torch.cuda.is_available()
    if t.device == "cuda" and not cuda:
        problems.append("trainer_args.device: cuda, but no CUDA GPU is visible to this process")
    if t.device == "cpu" or not cuda:
        where = "this run is on the CPU"
        if t.use_liger_kernel:
            problems.append(f"trainer_args.use_liger_kernel needs a CUDA GPU; {where}")
        attn = [("attn_backend", t.attn_backend if t.use_rmpad else "sdpa")]
        attn.append(("vision_attn_backend", t.vision_attn_backend))
        for key, value in attn:
            if value in _GPU_ATTENTION:
                problems.append(
                    f"trainer_args.{key}: {value!r} needs a CUDA GPU; {where} (use auto, sdpa)"
                )
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if t.loss_backend == "liger" or (t.loss_backend == "triton" and not interpreted):
            problems.append(
                f"trainer_args.loss_backend: {t.loss_backend!r} needs a CUDA GPU; {where} "
                "(use auto or torch)"
            )


def _exists(path: str) -> bool:
    from lmms_data import dataset_path_exists  # a glob as lmms-data expands it; URLs too

    return dataset_path_exists(path)


def _path_problems(cfg: TrainConfig, problems: list[str]) -> None:
    m, d = cfg.model_config, cfg.dataset_config
    generated = d.dataset_path if d.generate_synthetic is not None else None
    for key in ("dataset_path", "eval_dataset_path"):
        value = getattr(d, key)
        for path in [value] if isinstance(value, str) else value or []:
            if not path or path == generated:
                continue  # missing: reported by validate / generated at start
            if not _exists(path):
                problems.append(f"dataset_config.{key}: {path!r} does not exist")
            elif Path(path).is_file() and Path(path).stat().st_size == 0:
                problems.append(f"dataset_config.{key}: {path!r} is an empty file (0 bytes)")
    proc = d.processor_path or m.processor_path or m.load_from_pretrained_path
    if proc and not m.build_local_processor and not Path(proc).exists():
        problems.append(
            f"tokenizer/processor folder {proc!r} does not exist (set model_config.processor_path, "
            "or build_local_processor: true for a demo tokenizer)"
        )


def _output_problems(cfg: TrainConfig, problems: list[str]) -> None:
    t = cfg.trainer_args
    out = Path(t.output_dir)
    problem = _writable_dir_problem(out)
    if problem:
        problems.append(f"trainer_args.output_dir: {problem}")
        return
    ckpts = out / "checkpoints"
    if ckpts.exists():
        problem = _writable_dir_problem(ckpts)
        if problem:
            problems.append(f"trainer_args.output_dir: checkpoints folder {problem}")
    from lmms_train._run_folder import fresh_run_problem

    problem = fresh_run_problem(out, t.resume_from, t.overwrite_output_dir)
    if problem and not RunLock(out).held():  # a live run there: the lock says so, later
        problems.append(problem)
    if t.resume_from is not None:
        from lmms_train._checkpoint import RunCheckpointer

        try:
            RunCheckpointer(out, t.save_total_limit).resolve(t.resume_from)
        except UserError as exc:
            problems.append(str(exc))


def _writable_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be (created as) a writable folder, or None."""
    if path.exists():
        if not path.is_dir():
            return f"{str(path)!r} is a file, not a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{str(path)!r} is not writable by this process (read-only?)"
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{str(path)!r} cannot be created: {str(parent)!r} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{str(path)!r} cannot be created: {str(parent)!r} is not writable (read-only?)"
    return None


def config_differences(old: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """`section.key: old -> new` for each model_config / dataset_config value that differs."""
    new = config_to_dict(cfg)
    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b), key=str):
                walk(a.get(key), b.get(key), f"{where}.{key}")
        elif a != b:
            out.append(f"{where}: {a!r} -> {b!r}")

    for section in ("model_config", "dataset_config"):
        walk(old.get(section, {}), new.get(section, {}), section)
    return out


class RunLock:
    """An exclusive lock on an output folder for the duration of a run (rank 0 holds it)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        self._file: Any = None

    def acquire(self) -> None:
        """Take the lock or raise a `UserError` naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 -- held open for the run
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(
                f"trainer_args.output_dir {str(self.path.parent)!r} is in use by another run "
                f"({holder}); wait for it to end or choose another output_dir"
            ) from None
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        f.flush()
        self._file = f

    def held(self) -> bool:
        """Whether a live process holds the lock now (nothing is taken or written)."""
        try:
            with open(self.path) as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return False

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
