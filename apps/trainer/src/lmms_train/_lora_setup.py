"""`model_config.lora`: LoRA / QLoRA in the model set-up (lmms_models.apply_lora, peft's layers).

Where it sits in build_model's order: after the build (on the meta device under FSDP2) and the
objective's preparation, before Liger, attention, activation checkpointing, compile and FSDP2, so
the adapters live inside the same blocks that are checkpointed and sharded. A meta-device build
receives its base weights renamed for the adapted modules and the initial adapters in one
broadcast from rank 0 (:func:`adapted_weights`); a one-process build gets its adapters at once.
Both draw the same adapters (seeded by `trainer_args.seed` and the module name).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lmms_train._errors import ConfigError

__all__ = [
    "adapted_weights",
    "apply_model_lora",
    "check_lora",
    "lora_options",
    "quantize_model_base",
]


def lora_options(cfg: Any) -> Any:
    """`model_config.lora` as lmms_models.LoraOptions (None without it)."""
    lc = cfg.model_config.lora
    if lc is None:
        return None
    from lmms_models import LoraOptions

    targets: Any = lc.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    try:
        return LoraOptions(
            rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, target_modules=targets,
            towers=dict(lc.towers), train=list(lc.train), use_rslora=lc.use_rslora,
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"model_config.{exc}") from None


def check_lora(cfg: Any, env: Any) -> None:
    """Refuse, before the model is built, what LoRA does not compose with."""
    lc = cfg.model_config.lora
    if lc is None:
        return
    if lc.quantize_base == "nf4" and env.device.type != "cuda":
        raise ConfigError(
            "model_config.lora.quantize_base: nf4 (QLoRA, a 4-bit base) needs a CUDA GPU; "
            f"this run is on {env.device.type}: use quantize_base: none (plain LoRA) here"
        )
    if lc.quantize_base == "nf4" and env.fsdp and env.world_size < 2:
        raise ConfigError(
            "model_config.lora.quantize_base: nf4 with fsdp: true needs 2 or more ranks (FSDP2's "
            "one-rank path cannot all-gather the 4-bit NF4 tensor); on one GPU set fsdp: false "
            "(nothing to shard: the same memory)"
        )
    if env.tp > 1 or env.ep > 1:
        raise ConfigError(
            "model_config.lora with tp_degree/ep_degree > 1 is not supported: the adapters' A/B "
            "matrices have no TP/EP plan (LoRA composes with FSDP2 and Ulysses SP)"
        )


def check_preference(cfg: Any, env: Any, objective: Any, adapter: Any) -> None:
    """A preference objective (DPO) needs pairs and a reference: refuse what lacks them."""
    if not objective.preference:
        return
    name = cfg.model_config.objective
    if cfg.dataset_config.dataset_type != "preference":
        raise ConfigError(
            f"model_config.objective {name} trains on preference pairs: set "
            "dataset_config.dataset_type: preference (records with prompt/chosen/rejected or "
            "chosen/rejected conversations; docs/lora-dpo.md)"
        )
    if adapter is None and objective.needs_reference():
        raise ConfigError(
            f"model_config.objective {name} needs a reference policy: set model_config.lora "
            "(the reference is the base with the adapters off: no second model in memory), or "
            "objective_args.reference: precomputed with ref_chosen_logps / ref_rejected_logps "
            "in the data"
        )


def apply_model_lora(cfg: Any, spec: Any, model: nn.Module) -> Any:
    """Inject the adapters (lmms_models.LoraHandle) or return None without `model_config.lora`."""
    opts = lora_options(cfg)
    if opts is None:
        return None
    from lmms_models import apply_lora

    try:
        return apply_lora(spec, model, opts, seed=cfg.trainer_args.seed)
    except ValueError as exc:
        raise ConfigError(f"model_config.{exc}") from None
    except ImportError as exc:
        raise ConfigError(f"model_config.lora: {exc}") from None


def quantize_model_base(cfg: Any, handle: Any) -> None:
    """QLoRA: the adapted layers' base weights in NF4 (after the weights are on the GPU; under
    FSDP2 after the sharded load: each weight is re-sharded as 4-bit NF4 shards)."""
    if handle is None or cfg.model_config.lora.quantize_base != "nf4":
        return
    from lmms_models import quantize_base_nf4

    quantize_base_nf4(handle)


def adapted_weights(handle: Any, weights: Any, key_map: Any, seed: int) -> dict[str, Any]:
    """Rank 0's full state dict for a meta-device adapted model: the base weights (a folder or a
    state dict; `key_map` applied) renamed for the adapted modules, plus the initial adapters."""
    if isinstance(weights, dict):
        base = dict(weights)
    else:
        from lmms_parallel import read_safetensors

        base = read_safetensors(weights)
    if key_map is not None:
        base = {new: v for k, v in base.items() if (new := key_map(k)) is not None}
    return handle.adapted_state(base, seed)
