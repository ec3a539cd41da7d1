"""The key tables of `lmms-train convert-config` (lmms-engine / HF Trainer key -> lmms-train home).

Kept apart from the converter's logic in _convert_config.py; docs/migrating-from-lmms-engine.md
lists every key named here (a test checks it).
"""

from __future__ import annotations

import functools

DOC = "docs/migrating-from-lmms-engine.md"
_SECTIONS = ("model_config", "dataset_config", "trainer_args")
# keys whose presence marks an lmms-engine (or HF Trainer) config
_ENGINE_MARKS = {
    "trainer_args": {"per_device_train_batch_size", "num_train_epochs", "dataloader_num_workers",
                     "gradient_checkpointing", "fsdp2", "fsdp_config", "freeze_modules",
                     "use_muon", "optim"},
    "dataset_config": {"processor_config", "datasets"},
    "model_config": {"attn_implementation", "monkey_patch_kwargs", "overwrite_config"},
}  # fmt: skip
# trainer_args kept under the same name (lmms-train has the key with the same meaning)
_SAME = ("output_dir", "run_name", "seed", "learning_rate", "weight_decay", "adam_beta1",
         "adam_beta2", "adam_epsilon", "max_grad_norm", "warmup_ratio", "warmup_steps",
         "save_total_limit", "logging_steps", "bf16", "use_liger_kernel", "use_rmpad",
         "sp_ulysses_degree", "ep_degree", "tp_degree")  # fmt: skip
# HF Trainer bookkeeping with no meaning in lmms-train: dropped whatever the value
_HF_IGNORED = frozenset(
    [
        "overwrite_output_dir",
        "do_train",
        "do_eval",
        "do_predict",
        "prediction_loss_only",
        "per_device_eval_batch_size",
        "per_gpu_train_batch_size",
        "per_gpu_eval_batch_size",
        "eval_accumulation_steps",
        "eval_delay",
        "torch_empty_cache_steps",
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "logging_dir",
        "logging_strategy",
        "logging_first_step",
        "logging_nan_inf_filter",
        "save_strategy",
        "save_safetensors",
        "save_on_each_node",
        "save_only_model",
        "restore_callback_states_from_checkpoint",
        "no_cuda",
        "use_cpu",
        "use_mps_device",
        "jit_mode_eval",
        "fp16_opt_level",
        "half_precision_backend",
        "bf16_full_eval",
        "fp16_full_eval",
        "tf32",
        "local_rank",
        "ddp_backend",
        "tpu_num_cores",
        "tpu_metrics_debug",
        "debug",
        "dataloader_drop_last",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
        "past_index",
        "disable_tqdm",
        "remove_unused_columns",
        "label_names",
        "load_best_model_at_end",
        "metric_for_best_model",
        "greater_is_better",
        "ignore_data_skip",
        "accelerator_config",
        "length_column_name",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
        "ddp_timeout",
        "skip_memory_metrics",
        "use_legacy_prediction_loop",
        "hub_token",
        "hub_model_id",
        "hub_strategy",
        "hub_private_repo",
        "hub_always_push",
        "hub_revision",
        "push_to_hub_model_id",
        "push_to_hub_organization",
        "push_to_hub_token",
        "mp_parameters",
        "include_inputs_for_metrics",
        "include_for_metrics",
        "eval_do_concat_batches",
        "fp16_backend",
        "ray_scope",
        "include_tokens_per_second",
        "include_num_input_tokens_seen",
        "batch_eval_metrics",
        "eval_on_start",
        "eval_use_gather_object",
        "average_tokens_across_devices",
        "per_device_eval_batch_size",
        "use_cache",
        "print_batch_input_steps",
        "group_by_length",
        "train_sampling_strategy",
        "enable_jit_checkpoint",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing_kwargs",
        "liger_kernel_config",
        "eval_strategy",
        "full_determinism",
        "fsdp_min_num_params",
        "optim_target_modules",
        "torchdynamo",
        "xla",
        "xla_fsdp_v2",
        "xla_fsdp_grad_ckpt",
    ]
)
# HF settings that change training: fine at their default, a problem otherwise (value -> home)
_HF_DEFAULT_ONLY = {
    "fp16": (False, "lmms-train computes in bf16 (trainer_args.bf16) with fp32 master weights"),
    "label_smoothing_factor": (0.0, "not supported: the loss is plain token cross-entropy"),
    "neftune_noise_alpha": (None, "not supported"),
    "adafactor": (False, "trainer_args.optimizer is adamw or muon"),
    "optim_args": (None, "trainer_args.adam_beta1/adam_beta2/adam_epsilon, muon_momentum"),
    "auto_find_batch_size": (False, "batches are packed rows of dataset_config.packing_length"),
    "push_to_hub": (False, "trainer_args.export_hf writes output_dir/hf; upload that folder"),
    "parallelism_config": (None, "trainer_args.sp_ulysses_degree, dp_replicate, ep_degree"),
    "fsdp_transformer_layer_cls_to_wrap": (None, "lmms_models wraps every decoder/vision block"),
    "torch_compile_backend": (None, "trainer_args.compile uses Inductor"),
    "torch_compile_mode": (None, "trainer_args.compile uses Inductor's default mode"),
    "object_storage": ("none", "lmms-train reads local or mounted files (dataset_path)"),
    "bucket_name": (None, "lmms-train reads local or mounted files (dataset_path)"),
    "data_seed": (None, "dataset_config.seed"),
}
# settings at a value lmms-train always uses: accepted as no-ops with this note (other values
# are problems naming the home of the setting, as in _HF_DEFAULT_ONLY)
_SAME_AS_OURS = {
    "torch_compile_backend": (("inductor",), "trainer_args.compile compiles with Inductor"),
    "torch_compile_mode": (("default",), "trainer_args.compile uses Inductor's default mode"),
    "torch_dtype": (("bfloat16", "bf16", "float32", "auto"), "the weights load in fp32 (master "
                    "weights) and compute in bf16 with trainer_args.bf16"),
}  # fmt: skip
# Liger kernel toggles of monkey_patch_kwargs (lmms-engine's per-kernel switches) -> the note
_LIGER_TOGGLES = {
    "rope": "Liger's RoPE kernel: lmms-train never patches rotary embeddings (docs/kernels.md)",
    "swiglu": "Liger's SwiGLU kernel: applied to the family's MLPs whenever "
              "trainer_args.use_liger_kernel is on (no per-kernel switch; docs/kernels.md)",
    "rms_norm": "Liger's RMSNorm kernel: applied to the family's norms whenever "
                "trainer_args.use_liger_kernel is on (no per-kernel switch; docs/kernels.md)",
    "cross_entropy": "the loss is always a fused linear cross-entropy (trainer_args.loss_backend)",
    "fused_linear_cross_entropy": "the loss is always a fused linear cross-entropy "
                                  "(trainer_args.loss_backend)",
    "faster_token_stride": "LLaVA-Video slow-fast frames (add_faster_video) are not ported",
    "mm_spatial_pool_stride": "videos are pooled as the LLaVA-OneVision model's own config says",
    "mm_spatial_pool_mode": "videos are pooled as the LLaVA-OneVision model's own config says",
}  # fmt: skip
# lmms-engine trainers -> the lmms-train objective that trains the same thing
_TRAINERS = {"fsdp2_trainer": None, "hf_trainer": None, "dllm_trainer": "masked_diffusion"}
_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
              "cosine": "cosine", "cosine_with_min_lr": "cosine", "warmup_stable_decay": "wsd",
              "wsd": "wsd"}  # fmt: skip
_ATTENTION = {"flash_attention_2": "auto", "flash_attention_3": "auto", "sdpa": "sdpa",
              "eager": "sdpa", "flex_attention": "flex"}  # fmt: skip
# lmms-engine dataset types of chat records (each family adds its own: engine_dataset_types)
_CHAT_DATASET_TYPES = ("vision", "vision_iterable", "vision_audio", "vision_audio_iterable",
                       "qwen_omni_iterable", "multimodal", "chat")  # fmt: skip
# lmms-engine pretraining text datasets -> lmms-data's `text` adapter (plain text records)
_TEXT_DATASET_TYPES = ("fineweb_edu", "fineweb", "pretrain", "text_pretrain")
# the keys of lmms-engine's LLaVA-Video dataset extra_kwargs -> their lmms-train home
_VIDEO_EXTRA = {"data_folder": "dataset_config.data_folder",
                "frames_upbound": "dataset_config.video_max_frames"}  # fmt: skip
_FREEZE = {"visual": "vision_tower", "vision_tower": "vision_tower", "audio_tower": "audio_tower",
           "embed_tokens": "embeddings", "lm_head": "lm_head"}  # fmt: skip


def _registered_dataset_types() -> frozenset[str]:
    """The record adapters lmms-data has registered (kept as they are by the conversion)."""
    from lmms_data import DATASET_REGISTRY

    return frozenset(DATASET_REGISTRY.names())


def _specs() -> list:
    from lmms_models import get_model_spec, list_models

    return [get_model_spec(name) for name in list_models()]


@functools.cache
def engine_model_types() -> dict[str, tuple[str, str | None]]:
    """lmms-engine ``model_type`` -> (the lmms-train family, its objective or None), as the
    families declare them (``ModelSpec.engine_model_types``)."""
    found: dict[str, tuple[str, str | None]] = {}
    for spec in _specs():
        for engine, objective in spec.engine_model_types.items():
            if engine in found and found[engine][0] != spec.name:
                raise RuntimeError(f"lmms-engine model_type {engine!r} is claimed by the "
                                   f"{found[engine][0]} and {spec.name} families")  # fmt: skip
            found[engine] = (spec.name, objective)
    return found


@functools.cache
def engine_chat_dataset_types() -> frozenset[str]:
    """lmms-engine ``dataset_type`` values whose records are chat records: the common ones and
    those the families declare (``ModelSpec.engine_dataset_types``)."""
    return frozenset(_CHAT_DATASET_TYPES).union(*(s.engine_dataset_types for s in _specs()))
