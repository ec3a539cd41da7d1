"""Model checks before the model is built: the config dict, the objective and the layout.

`model_problems(cfg, spec)` is part of the preflight (`_preflight.config_problems`): from the
family's config object alone (cheap: no weights), it finds

- keys of `model_config.load_from_config.config` that the family's config ignores (a typo such
  as `hiden_size` would be stored by transformers and never read), with a suggestion, and a
  config the family's config class rejects;
- an objective the family cannot train: each objective declares what it `requires`
  (`lmms_models.objectives.CAPABILITIES`) and each family what it offers
  (`ModelSpec.objective_capabilities`); the message lists the registered families that fit;
- a sequence-parallel, tensor-parallel or expert-parallel degree the family cannot run
  (`ModelSpec.check_sp` / `check_tp`, its plans), or that the launch's world size cannot hold.

Every problem is returned, none raised: the CLI reports them with the rest of the config's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmms_train._errors import ConfigError
from lmms_train.config import TrainConfig

__all__ = ["model_problems"]

# model-config keys that lmms sets from its own options (the config's value would be overridden)
_TRAINER_OWNED = {"attn_implementation": "trainer_args.attn_backend"}


def model_problems(cfg: TrainConfig, spec: Any) -> list[str]:
    """Every problem of the model section visible from the family's config object."""
    problems: list[str] = []
    hf_config = _config_object(cfg, spec, problems)
    _objective_problems(cfg, spec, problems)
    _layout_problems(cfg, spec, hf_config, problems)
    return problems


def _config_object(cfg: TrainConfig, spec: Any, problems: list[str]) -> Any:
    """The family's config object (None where it cannot be read here), after checking the
    keys of `load_from_config.config`."""
    from lmms_train._model_setup import model_config_dict

    m = cfg.model_config
    lfc = m.load_from_config
    if lfc is None:
        return _pretrained_config(spec, m.load_from_pretrained_path)
    try:
        conf = model_config_dict(cfg, spec, None)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None
    unknown = spec.unknown_config_keys(lfc.config, conf) if lfc.config else []
    if unknown:
        owned = [f"{k}: set {v} instead" for k, v in _TRAINER_OWNED.items() if k in lfc.config]
        problems.append(
            f"model_config.load_from_config.config: {spec.name}'s config does not read "
            f"{', '.join(unknown)} (it would be ignored)" + "".join(f"; {o}" for o in owned)
        )
    try:
        hf_config = spec.make_config(conf)
    except (TypeError, ValueError, KeyError) as exc:
        if not unknown:  # an unknown key is the reason, already reported
            problems.append(f"model_config.load_from_config.config: invalid for {spec.name}: {exc}")
        return None
    problems.extend(_size_problems(spec.text_config(hf_config)))
    return hf_config


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "depth", "num_heads")  # fmt: skip


def _size_problems(text: Any) -> list[str]:
    """Sizes of the (text) config that no model can have: not a positive integer, or attention
    heads that the KV heads do not divide (grouped-query attention)."""
    where = "model_config.load_from_config.config"
    values = {k: getattr(text, k, None) for k in _SIZES}
    out = [
        f"{where}: {k} must be a positive integer, got {v!r}"
        for k, v in values.items()
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)
    ]
    heads, kv = values["num_attention_heads"], values["num_key_value_heads"]
    if not out and heads and kv and heads % kv:
        out.append(f"{where}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
    return out


def _pretrained_config(spec: Any, path: str | None) -> Any:
    """The config object of a local checkpoint folder's `config.json` (None if unreadable:
    the build reports it)."""
    file = Path(path or "") / "config.json"
    try:
        raw = json.loads(file.read_text())
        raw.pop("model_type", None)  # a release's own type (e.g. Dream's) names this family
        return spec.make_config(raw)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _objective_problems(cfg: TrainConfig, spec: Any, problems: list[str]) -> None:
    """The objective's name and options, and whether it fits the family (also when its
    options are wrong: both are reported)."""
    from lmms_models import get_model_spec, list_models
    from lmms_models.objectives import OBJECTIVE_REGISTRY
    from lmms_train._model_setup import build_objective

    try:
        build_objective(cfg, spec)
    except ConfigError as exc:
        problems.extend(exc.problems)
    cls = OBJECTIVE_REGISTRY.get(cfg.model_config.objective)
    problem = None if cls is None else cls.family_problem(spec)
    if problem is not None:
        fits = [n for n in list_models() if cls.family_problem(get_model_spec(n)) is None]
        problems.append(
            f"model_config.objective: {problem}; families it trains: {', '.join(fits) or 'none'}"
        )


def _launch_problems(cfg: TrainConfig, problems: list[str]) -> None:
    """The parallel degrees against the launch's world size (torchrun's `WORLD_SIZE`)."""
    t = cfg.trainer_args
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp, dp, tp = t.sp_ulysses_degree, t.dp_replicate, t.tp_degree
    if min(sp, dp, tp) >= 1 and world % (sp * dp * tp):
        problems.append(
            f"world size {world} is not divisible by sp_ulysses_degree ({sp}) x dp_replicate "
            f"({dp}) x tp_degree ({tp}) = {sp * dp * tp}; launch a multiple of it"
        )
    if (tp > 1 or t.ep_degree > 1) and world == 1:
        problems.append("tp_degree / ep_degree > 1 need several processes (torchrun)")
    if world > 1 and t.fsdp is False:
        problems.append("trainer_args.fsdp: false is only supported on one process")


def _layout_problems(cfg: TrainConfig, spec: Any, hf_config: Any, problems: list[str]) -> None:
    t = cfg.trainer_args
    _launch_problems(cfg, problems)
    if t.sp_ulysses_degree > 1:
        try:  # without a readable config (None): whether the family runs SP at all
            spec.check_sp(hf_config, t.sp_ulysses_degree)
        except (ValueError, NotImplementedError) as exc:
            problems.append(f"trainer_args.sp_ulysses_degree: {exc}")
    if t.tp_degree > 1:
        if hf_config is not None:
            try:
                spec.check_tp(hf_config, t.tp_degree)
            except (ValueError, NotImplementedError) as exc:
                problems.append(f"trainer_args.tp_degree: {exc}")
        if t.tp_sequence_parallel and not spec.tp_sp_plan:
            problems.append(
                f"trainer_args.tp_sequence_parallel: {spec.name} has no sequence-parallel TP "
                "plan; set it to false"
            )
    if t.ep_degree > 1 and not spec.ep_plan:
        problems.append(f"trainer_args.ep_degree: {spec.name} has no expert-parallel plan")
    _placement_problems(cfg, spec, problems)


def _placement_problems(cfg: TrainConfig, spec: Any, problems: list[str]) -> None:
    """FSDP-only switches without FSDP, frozen-encoder placement on a family without one (the
    build's own checks, run here with the FSDP choice the launch will make)."""
    from types import SimpleNamespace

    from lmms_train._model_setup import _check_frozen_encoders

    t = cfg.trainer_args
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fsdp = t.fsdp if t.fsdp is not None else (world > 1 or t.fsdp_cpu_offload)
    if t.fsdp_cpu_offload and not fsdp:
        problems.append("trainer_args.fsdp_cpu_offload needs FSDP: set trainer_args.fsdp: true")
    try:
        _check_frozen_encoders(spec, SimpleNamespace(fsdp=fsdp), t)
    except ConfigError as exc:
        problems.extend(exc.problems)
