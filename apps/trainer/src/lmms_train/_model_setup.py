"""Model set-up: spec lookup, config assembly, build, freeze, kernels, AC, SP and FSDP2.

Order (STYLE.md #3): build (on several ranks: on the meta device, with the weights read or
randomly initialised once on rank 0; on one process: directly on the device) -> freeze -> Liger
-> attention (+ Ulysses wrapper) -> activation checkpointing -> compile (per block) -> FSDP2 ->
materialise and load the weights (rank 0 broadcasts into every rank's shards). Without FSDP2
(one process, unless `fsdp: true`) bf16 comes from `lmms_parallel.MasterWeights` instead, last:
the same arithmetic as FSDP2's MixedPrecisionPolicy without its one-rank copies.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmms_train._dist import DistEnv
from lmms_train._errors import ConfigError, UserError, suggest
from lmms_train._lora_setup import (
    adapted_weights,
    apply_model_lora,
    check_lora,
    check_preference,
    quantize_model_base,
)
from lmms_train.config import TrainConfig

__all__ = ["BuiltModel", "ac_plan", "build_model", "build_objective", "deep_merge", "resolve_spec"]


@dataclass(kw_only=True, slots=True)
class BuiltModel:
    spec: Any
    model: nn.Module
    hf_config: Any
    frozen: list[str]
    handles: list[Any]  # patch/AC handles kept alive for the run
    master: Any = None  # lmms_parallel.MasterWeights when bf16 without FSDP2
    objective: Any = None  # lmms_models.objectives.Objective, prepared on this model
    adapter: Any = None  # lmms_models.LoraHandle under `model_config.lora`

    @property
    def state_module(self) -> nn.Module:
        """What checkpoints and exports read: the fp32 masters where there are any."""
        return self.model if self.master is None else self.master.state_module()


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`, recursing into nested dicts."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve_spec(cfg: TrainConfig) -> Any:
    """The registered model spec named by the config; the error lists the registered ones."""
    from lmms_models import get_model_spec, list_models

    m = cfg.model_config
    if m.load_from_config is not None:
        name = m.load_from_config.model_type
    else:
        name = m.model_type
        if name is None:
            cfg_file = Path(m.load_from_pretrained_path or "") / "config.json"
            if not cfg_file.is_file():
                raise UserError(
                    f"model_config.load_from_pretrained_path: no config.json in {m.load_from_pretrained_path!r}"
                    " (only local folders are supported; set model_config.model_type to override)"
                )
            name = json.loads(cfg_file.read_text()).get("model_type", "")
            from lmms_models.layouts import DLLM_LAYOUTS

            if name in DLLM_LAYOUTS:  # a dLLM release in its family's layout (e.g. Dream: qwen2)
                name = DLLM_LAYOUTS[name].family
    registered = list_models()
    if name not in registered:  # a folder type a family loads (spec.folder_model_types)
        owners = [n for n in registered if name in get_model_spec(n).folder_model_types]
        name = owners[0] if len(owners) == 1 else name
    if name not in registered:
        from lmms_models import unavailable_models

        why = unavailable_models().get(name)  # a family whose optional dependency fails here
        if why is not None:
            raise ConfigError(f"model_config: {why}")
        raise ConfigError(
            f"model type {name!r} is not registered{suggest(name, registered)}; "
            f"registered: {', '.join(registered)}"
        )
    return get_model_spec(name)


def build_objective(cfg: TrainConfig, spec: Any = None) -> Any:
    """The run's objective (`model_config.objective` with `objective_args`); errors name the
    registered objectives and the objective's options."""
    from lmms_models.objectives import OBJECTIVE_REGISTRY, get_objective, list_objectives

    m = cfg.model_config
    names = list_objectives()
    if m.objective not in names:
        raise ConfigError(
            f"model_config.objective {m.objective!r} is not registered"
            f"{suggest(m.objective, names)}; registered: {', '.join(names)}"
        )
    args = dict(m.objective_args)
    if spec is not None and spec.default_objective == m.objective:
        args = {**spec.objective_defaults, **args}  # the family's parameterisation (wan: RF)
    layout_shift = OBJECTIVE_REGISTRY[m.objective].layout_shift
    if layout_shift and "shift" not in args and m.load_from_pretrained_path:
        from lmms_models.layouts import read_layout

        try:  # a release's layout says how its positions predict (Dream: shifted)
            _, _, shift = read_layout(m.load_from_pretrained_path)
        except FileNotFoundError:
            shift = None
        if shift is not None:
            args["shift"] = shift
    try:
        return get_objective(m.objective, **args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model_config.objective_args: {exc}") from None


def _set_where_present(conf: dict[str, Any], key: str, value: Any) -> bool:
    hit = False
    for node in (conf, conf.get("text_config"), conf.get("vision_config"), conf.get("llm")):
        if isinstance(node, dict) and key in node:
            node[key] = max(node[key], value) if key == "vocab_size" else value
            hit = True
    return hit


def model_config_dict(
    cfg: TrainConfig, spec: Any, token_ids: dict[str, Any] | None
) -> dict[str, Any]:
    """The HF config dict for `load_from_config`: the family's tiny config (if `tiny`), the
    token ids of a locally built processor (so the embedding table matches the tokenizer), then
    the user's keys (which win)."""
    lfc = cfg.model_config.load_from_config
    assert lfc is not None
    if lfc.tiny and lfc.preset:
        raise ConfigError("model_config.load_from_config: set tiny or preset, not both")
    try:
        conf = spec.tiny_config() if lfc.tiny else spec.preset(lfc.preset) if lfc.preset else {}
    except KeyError as exc:
        raise ConfigError(f"model_config.load_from_config.preset: {exc.args[0]}") from None
    for key, value in (token_ids or {}).items():
        relevant = (key == "vocab_size" or key.endswith("_token_id")) and isinstance(value, int)
        if (
            relevant
            and not _set_where_present(conf, key, value)
            and key != "vocab_size"
            and lfc.tiny
        ):
            conf[key] = value
    return deep_merge(conf, lfc.config)


def _freeze(model: nn.Module, spec: Any, names: list[str]) -> list[str]:
    named = {
        "vision_tower": lambda: [spec.vision_tower(model)],
        "embeddings": lambda: spec.embeddings(model),
        "lm_head": lambda: [spec.lm_head(model)],
        "language_model": lambda: [spec.text_model(model)],
    }
    params = dict(model.named_parameters())
    frozen: list[str] = []
    for name in names:
        if name in named:
            mods = [m for m in named[name]() if m is not None]
            if not mods:
                raise ConfigError(f"trainer_args.freeze: {spec.name} has no {name}")
            for mod in mods:
                for p in mod.parameters():
                    p.requires_grad_(False)
            frozen.append(name)
            continue
        hits = [n for n in params if n == name or n.startswith(name + ".")]
        if not hits:
            prefixes = sorted({".".join(n.split(".")[:k]) for n in params for k in (1, 2, 3)})
            raise ConfigError(
                f"trainer_args.freeze: {name!r} matches no module{suggest(name, list(named) + prefixes)}; "
                f"use {', '.join(named)} or a module path prefix"
            )
        for n in hits:
            params[n].requires_grad_(False)
        frozen.append(name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("trainer_args.freeze froze every parameter: nothing to train")
    return frozen


def _check_frozen_encoders(spec: Any, env: DistEnv, t: Any) -> None:
    """`frozen_encoders` other than `replicate`: only for a family whose frozen encoders run on
    the fly and can be placed (`GeneratesLatents.placeable_encoders`, e.g. a text encoder)."""
    from lmms_models import GeneratesLatents

    placeable = isinstance(spec, GeneratesLatents) and spec.placeable_encoders
    if t.frozen_encoders != "replicate" and not placeable:
        raise ConfigError(
            f"trainer_args.frozen_encoders: {t.frozen_encoders} is for families with a frozen "
            f"text encoder run on the fly (spec.placeable_encoders), not {spec.name}"
        )
    if t.frozen_encoders == "shard" and not env.fsdp:
        raise ConfigError("trainer_args.frozen_encoders: shard needs FSDP: set trainer_args.fsdp")


def build_model(
    cfg: TrainConfig, env: DistEnv, spec: Any, token_ids: dict[str, Any] | None
) -> BuiltModel:
    """Build and parallelise the model for this rank."""
    m, t = cfg.model_config, cfg.trainer_args
    if t.fsdp_cpu_offload and not env.fsdp:
        raise ConfigError("trainer_args.fsdp_cpu_offload needs FSDP: set trainer_args.fsdp: true")
    _check_frozen_encoders(spec, env, t)
    check_lora(cfg, env)  # before the build: e.g. a 4-bit base on CPU
    built = _construct(cfg, env, spec, token_ids)
    model = built.model
    objective = build_objective(cfg, spec)
    try:
        objective.prepare_model(spec, model)  # e.g. bidirectional attention, before any wrapping
    except (ValueError, NotImplementedError) as exc:
        raise ConfigError(f"model_config.objective {m.objective!r}: {exc}") from None
    adapter = apply_model_lora(cfg, spec, model)  # inside the blocks FSDP2 and AC wrap
    check_preference(cfg, env, objective, adapter)  # DPO: pairs and a reference
    frozen = _freeze(model, spec, t.freeze)
    if built.on_host:
        _frozen_to_device(model, env, t.bf16)
    handles: list[Any] = []
    units = _apply_patches(cfg, env, spec, built, handles, objective.vocab_parallel_head)
    if env.fsdp:
        _shard(model, spec, env, t, units)
        if built.meta:
            weights, built.weights = built.weights, None  # rank 0's full copy: freed once loaded
            _load_shards(model, spec, env, t, weights, adapter)
            del weights
    _place_frozen_encoders(model, spec, env, t)
    master = None
    if not env.fsdp and t.bf16:
        from lmms_parallel import MasterWeights

        master = MasterWeights(model, torch.bfloat16)
    quantize_model_base(cfg, adapter)  # QLoRA: the frozen base of the adapted layers in NF4
    return BuiltModel(
        spec=spec, model=model, hf_config=built.hf_config, frozen=frozen, handles=handles,
        master=master, objective=objective, adapter=adapter,
    )  # fmt: skip


@dataclass(kw_only=True, slots=True)
class _Constructed:
    """The model as first built: on the device, or on the meta device (`meta`) to be
    materialised after FSDP2 with `weights` (rank 0's state dict or checkpoint path) loaded."""

    model: nn.Module
    hf_config: Any
    meta: bool
    weights: Any  # what rank 0 broadcasts into the shards (a path, a state dict or None)
    on_host: bool = False  # one process with LoRA: built on the CPU, moved once the base is frozen


def _construct(
    cfg: TrainConfig, env: DistEnv, spec: Any, token_ids: dict[str, Any] | None
) -> _Constructed:
    """The model from `load_from_config` (a random init on the CPU generator, seeded) or
    `load_from_pretrained_path`; on several ranks (or FSDP2 from a checkpoint) on meta."""
    m, t = cfg.model_config, cfg.trainer_args
    meta = env.fsdp and m.load_from_pretrained_path is not None
    weights: Any = m.load_from_pretrained_path  # what rank 0 broadcasts into the shards
    if weights is not None:  # the family's file (e.g. one of several) or the folder
        weights = str(spec.weights_file(weights))
    backends = dict(attn_backend=_attn_backend(t), vision_attn_backend=t.vision_attn_backend)
    # One process with LoRA: the model stays on the CPU until its base is frozen and cast to bf16
    # (`_frozen_to_device`), so a 7B base never sits on the GPU in fp32 (31.4 GiB at the start of
    # a QLoRA run whose training peak is 14.1 GiB: RESULTS.md, issue 41).
    on_host = not env.distributed and not meta and m.lora is not None
    device = torch.device("cpu") if on_host else env.device
    try:
        if m.load_from_config is not None:
            conf = model_config_dict(cfg, spec, token_ids)
            hf_config = spec.make_config(conf)
            torch.manual_seed(t.seed)
            if not env.distributed:
                # random init on the CPU generator whatever the device (as the distributed path
                # below): a seed gives the same weights on a GPU as on the CPU (a CUDA generator
                # draws other numbers: BAGEL's GPU run started 2.8% off its CPU run)
                model = spec.build(config=conf, device="cpu", **backends).to(device)
                return _Constructed(
                    model=model, hf_config=hf_config, meta=meta, weights=weights, on_host=on_host
                )
            # Random init once, on rank 0 (same seed, same weights as a 1-process run); every
            # rank builds on meta and receives its shards: no full copy per rank.
            from lmms_parallel import meta_init

            weights = (
                spec.build(config=conf, device="cpu", **backends).state_dict()
                if env.rank == 0
                else None
            )
            with meta_init():
                model = spec.build(config=conf, device="meta", **backends)
            return _Constructed(model=model, hf_config=hf_config, meta=True, weights=weights)
        if meta:
            from lmms_parallel import meta_init

            with meta_init():
                model = spec.build(
                    pretrained=m.load_from_pretrained_path, device="meta", **backends
                )
        else:
            model = spec.build(pretrained=m.load_from_pretrained_path, device=device, **backends)
        return _Constructed(
            model=model, hf_config=model.config, meta=meta, weights=weights, on_host=on_host
        )
    except (ValueError, TypeError, OSError) as exc:
        raise UserError(f"model_config: could not build {spec.name}: {exc}") from exc


def _frozen_to_device(model: nn.Module, env: DistEnv, bf16: bool) -> None:
    """Move a host-built model to the device, its frozen floating-point parameters first cast to
    bf16 under `bf16` (what `MasterWeights` would do on the device: same values, half the bytes
    moved and no fp32 copy of the base on the GPU)."""
    if bf16:
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
    model.to(env.device)


def _apply_patches(
    cfg: TrainConfig,
    env: DistEnv,
    spec: Any,
    built: _Constructed,
    handles: list[Any],
    vocab_parallel_head: bool,
) -> list[tuple[nn.Module, Any]]:
    """Everything applied to the single-device model before FSDP2, in order: the linear patch
    embedding, Liger, the TP/EP plans, Ulysses attention, activation checkpointing, compile.
    Their handles go to `handles`; returns the experts' FSDP2 units under EP (the TP/EP plans
    come first; `vocab_parallel_head`: the objective's loss takes a vocab-parallel LM head)."""
    t, model = cfg.trainer_args, built.model
    if t.linear_patch_embed:
        from lmms_models import linear_patch_embed

        handles.append(linear_patch_embed(spec.vision_tower(model)))
    if t.use_liger_kernel and spec.liger_plan:  # the family's modules to patch
        handles.append(_apply_liger(model, spec, env))
    units = _apply_plans(model, spec, env, t, built.hf_config, handles, vocab_parallel_head)
    if env.sp > 1:
        from lmms_parallel import UlyssesAttention, sp_group

        wrapper = UlyssesAttention(sp_group(env.mesh))
        spec.set_attention(
            model, backend=_attn_backend(t), wrapper=wrapper, vision_backend=t.vision_attn_backend
        )  # inputs are sliced in _forward
    handles += _apply_ac(model, spec, t)
    if t.compile:
        handles.append(_apply_compile(model, spec))
    return units


def _shard(
    model: nn.Module, spec: Any, env: DistEnv, t: Any, units: list[tuple[nn.Module, Any]]
) -> None:
    """FSDP2 over the vision and decoder blocks and the embeddings (and the experts' units)."""
    from lmms_parallel import apply_fsdp, fsdp_mesh

    blocks = spec.vision_blocks(model) + spec.decoder_blocks(model) + spec.embeddings(model)
    apply_fsdp(
        model,
        fsdp_mesh(env.mesh),
        blocks=blocks,
        param_dtype=torch.bfloat16 if t.bf16 else None,
        reshard_after_forward=t.reshard_after_forward,
        cpu_offload=t.fsdp_cpu_offload,
        units=units,
    )


def _load_shards(
    model: nn.Module, spec: Any, env: DistEnv, t: Any, weights: Any, adapter: Any
) -> None:
    """Materialise a meta-built sharded model and load the weights rank 0 reads (a path, read
    by the family, or rank 0's random init), broadcast into every rank's shards."""
    from lmms_models.layouts.llada import pretrained_key_map
    from lmms_parallel import load_full_state_dict, materialize

    materialize(model, env.device)
    key_map = pretrained_key_map(weights) if isinstance(weights, str) else None  # LLaDA
    if isinstance(weights, str) and env.rank == 0:  # a path, or read by the family
        weights = spec.pretrained_weights(weights)  # (e.g. an Omni thinker)
    if adapter is not None and env.rank == 0:  # base keys renamed, initial adapters
        weights, key_map = adapted_weights(adapter, weights, key_map, t.seed), None
    load_full_state_dict(model, weights if env.rank == 0 else None, key_map=key_map)


def _attn_backend(t: Any) -> str:
    """The decoder's attention: the configured varlen backend on packed rows, else SDPA."""
    return t.attn_backend if t.use_rmpad else "sdpa"


def _place_frozen_encoders(model: nn.Module, spec: Any, env: DistEnv, t: Any) -> None:
    """`frozen_encoders`: how a diffusion family's on-the-fly encoders are held (built lazily,
    on first use, as lmms_models.place_encoders says); the config was checked in build_model."""
    if t.frozen_encoders == "replicate":
        return
    from lmms_models import place_encoders

    mesh = None
    if t.frozen_encoders == "shard":
        from lmms_parallel import fsdp_mesh

        mesh = fsdp_mesh(env.mesh)
    place_encoders(
        model, t.frozen_encoders, blocks=spec.encoder_blocks, device=env.device, mesh=mesh,
        dtype=torch.bfloat16 if t.bf16 else None,
    )  # fmt: skip


def _apply_plans(
    model: nn.Module,
    spec: Any,
    env: DistEnv,
    t: Any,
    hf_config: Any,
    handles: list[Any],
    vocab_parallel_head: bool = True,
) -> list[tuple[nn.Module, Any]]:
    """MoE families: the experts implementation (`experts_backend`) and the expert-load meter
    (metrics `moe/*`); then the spec's TP plan (`tp_degree`) or EP plan (`ep_degree`), applied by
    lmms-parallel; under TP, for an objective whose loss takes it (`Objective.vocab_parallel_head`:
    `causal_lm`), also the LM head's vocab-parallel plan (its loss never gathers [T, vocab]; a
    head tied to the embeddings stays replicated).
    Returns the FSDP2 units of the experts under EP (sharded over the ranks that hold the same
    experts)."""
    from lmms_models import HasExperts

    if isinstance(spec, HasExperts):
        from lmms_models import ExpertLoadMeter

        try:
            spec.set_experts(model, t.experts_backend)
        except ValueError as exc:
            raise ConfigError(f"trainer_args.experts_backend: {exc}") from None
        handles.append(ExpertLoadMeter(spec, model))
    if env.tp > 1:
        from lmms_parallel import apply_tp, tp_mesh

        try:
            spec.check_tp(hf_config, env.tp)
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(f"trainer_args.tp_degree: {exc}") from None
        plan = spec.tp_plan
        if t.tp_sequence_parallel:
            if not spec.tp_sp_plan:
                raise ConfigError(
                    f"trainer_args.tp_sequence_parallel: {spec.name} has no sequence-parallel TP "
                    "plan (spec.tp_sp_plan); set it to false"
                )
            plan = spec.tp_sp_plan
        apply_tp(spec.plan_root(model), plan, tp_mesh(env.mesh), styles=spec.plan_styles())
        head = spec.lm_head(model)
        tied = head.weight is spec.embeddings(model)[0].weight
        if vocab_parallel_head and spec.tp_head_plan and not tied:
            try:
                apply_tp(model, spec.tp_head_plan, tp_mesh(env.mesh))
            except (ValueError, TypeError) as exc:  # e.g. a vocabulary tp does not divide
                raise ConfigError(f"trainer_args.tp_degree: {exc}") from None
    if env.ep <= 1:
        return []
    if not spec.ep_plan:
        raise ConfigError(f"trainer_args.ep_degree: {spec.name} has no expert-parallel plan")
    n_experts = spec.text_config(hf_config).num_experts
    if n_experts % env.ep:
        raise ConfigError(f"trainer_args.ep_degree {env.ep} must divide the {n_experts} experts")
    from lmms_parallel import apply_ep, expert_meshes

    meshes = expert_meshes(env.mesh, env.ep)
    apply_ep(spec.plan_root(model), spec.ep_plan, meshes.ep_group)
    return [(m, meshes.fsdp) for m in spec.experts_modules(model)]


def ac_plan(t: Any) -> dict[str, tuple[str, float]]:
    """`{"decoder": (mode, fraction), "vision": (mode, fraction)}` from `trainer_args`."""
    lm = (t.activation_checkpointing, t.activation_checkpointing_fraction)
    vis_mode = t.vision_activation_checkpointing
    vision = lm if vis_mode == "same" else (vis_mode, t.vision_activation_checkpointing_fraction)
    return {"decoder": lm, "vision": vision}


def _apply_ac(model: nn.Module, spec: Any, t: Any) -> list[Any]:
    """Activation checkpointing of the chosen decoder and vision blocks (before FSDP)."""
    from lmms_parallel import apply_activation_checkpointing

    handles = []
    towers = {"decoder": spec.decoder_blocks(model), "vision": spec.vision_blocks(model)}
    for tower, (mode, fraction) in ac_plan(t).items():
        handles.append(apply_activation_checkpointing(towers[tower], mode, fraction=fraction))
    return handles


COMPILE_BACKEND_ENV = "LMMS_TRAIN_COMPILE_BACKEND"


def _apply_compile(model: nn.Module, spec: Any) -> Any:
    """`torch.compile` every vision and decoder block (after AC, so each checkpoint sits inside
    its compiled block; before FSDP, whose hooks stay outside). Inductor unless the environment
    variable `LMMS_TRAIN_COMPILE_BACKEND` names another dynamo backend (`aot_eager` checks the
    tracing without Inductor's code generation: the tests use it on CPU)."""
    from lmms_kernels import compile_blocks

    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    return compile_blocks(spec.vision_blocks(model) + spec.decoder_blocks(model), backend=backend)


def _apply_liger(model: nn.Module, spec: Any, env: DistEnv) -> Any:
    if env.device.type != "cuda":
        raise ConfigError("trainer_args.use_liger_kernel: Liger's kernels need a CUDA GPU")
    try:
        from lmms_kernels import apply_liger
    except ImportError as exc:
        raise UserError(f"use_liger_kernel: lmms_kernels.apply_liger unavailable: {exc}") from exc
    return apply_liger(model, spec.liger_plan)
