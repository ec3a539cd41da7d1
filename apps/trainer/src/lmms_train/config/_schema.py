"""The typed run configuration: three sections, each a small dataclass with documented keys.

Every field carries ``metadata["doc"]``; docs/config.md is generated from it
(``lmms-train docs``), and a test checks that the page is current, so no key goes undocumented.
"""

# ruff: noqa: RUF009 -- `_f` returns a dataclasses.field (default + doc metadata)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "DatasetConfig",
    "LoadFromConfig",
    "LoraConfig",
    "ModelConfig",
    "SyntheticDataConfig",
    "TrainConfig",
    "TrainerArgs",
]


def _f(default: Any, doc: str) -> Any:
    """A dataclass field with a documented default (lists/dicts get a factory)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(kw_only=True, slots=True)
class LoadFromConfig:
    """Build a model from a config instead of loading weights (random initialisation)."""

    model_type: str = _f("", "Registered model family (`lmms_models` registry), e.g. `qwen2_5_vl`.")
    tiny: bool = _f(
        False,
        "Start from the family's tiny test config (`spec.tiny_config()`) and apply `config` on top.",
    )
    preset: str | None = _f(
        None,
        "Start from a real-size preset of the family (e.g. `3b`; random weights, for benchmarks).",
    )
    config: dict[str, Any] = _f(
        {}, "HF config keys (nested dicts merge recursively), e.g. `{hidden_size: 64}`."
    )


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters (peft's LoRA layers; docs/lora-dpo.md). Present: the base is frozen and only
    the adapters (plus `full` towers and `train` modules) train."""

    rank: int = _f(16, "Adapter rank r (`A [r, in]`, `B [out, r]`).")
    alpha: float = _f(
        32.0, "Scale: the update is `alpha / rank · B A` (`alpha / sqrt(rank)` with `use_rslora`)."
    )
    dropout: float = _f(0.0, "Dropout on the adapter input (peft's `lora_dropout`).")
    target_modules: list[str] = _f(
        ["all-linear"],
        "`all-linear` (every linear layer of the `lora` towers; never the LM head) or module-name "
        "patterns: a suffix (`q_proj`, `mlp.down_proj`) or a regular expression on the full name.",
    )
    towers: dict[str, str] = _f(
        {"decoder": "lora"},
        "Per tower (`decoder`, `vision`, `audio`, as the family declares them): `lora`, `frozen` "
        "or `full` (trained whole). Towers not named are frozen.",
    )
    train: list[str] = _f(
        [], "Module-name prefixes trained whole besides (e.g. `lm_head`, a projector)."
    )
    use_rslora: bool = _f(False, "rsLoRA scaling `alpha / sqrt(rank)`.")
    quantize_base: Literal["none", "nf4"] = _f(
        "none",
        "`nf4`: QLoRA, the frozen base linear weights of the `lora` towers in 4-bit NF4 "
        "(torchao; `pip install lmms-models[qlora]`). Needs a CUDA GPU.",
    )


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """What model to train and where its tokenizer/processor comes from."""

    load_from_pretrained_path: str | None = _f(
        None,
        "Local folder, or Hugging Face Hub id (`org/name`, `org/name@revision`: downloaded once into "
        "the HF cache; docs/weights.md), of a pretrained HF checkpoint to load.",
    )
    load_from_config: LoadFromConfig | None = _f(
        None, "Build from a config instead: `{model_type, tiny, config}`."
    )
    model_type: str | None = _f(
        None,
        "Model family for `load_from_pretrained_path` (default: the checkpoint's `model_type`).",
    )
    processor_path: str | None = _f(
        None,
        "Folder or Hub id of the tokenizer/processor (default: `load_from_pretrained_path`).",
    )
    build_local_processor: bool = _f(
        False,
        "If `processor_path` does not exist, build a small tokenizer/processor there locally "
        "(a byte-level BPE trained on a fixed corpus; no download). For demos and tests.",
    )
    objective: str = _f(
        "causal_lm",
        "Training objective (`lmms_models.objectives` registry), separate from the family: "
        "`causal_lm` (next-token cross-entropy), `masked_diffusion` (diffusion LM: bidirectional "
        "attention inside each sample, masked tokens weighted 1/t; docs/diffusion-lm.md), "
        "`flow_matching` (diffusion transformers), `dpo` (preference pairs against the base "
        "with the LoRA adapters off; docs/lora-dpo.md).",
    )
    objective_args: dict[str, Any] = _f(
        {},
        "Options of the objective, e.g. `{mask_token_id: 151666, eps: 0.001, shift: false}` "
        "for `masked_diffusion` (unknown keys are errors).",
    )
    lora: LoraConfig | None = _f(
        None,
        "LoRA / QLoRA adapters instead of full fine-tuning (`{rank, alpha, target_modules, "
        "towers, ...}`; docs/lora-dpo.md).",
    )


@dataclass(kw_only=True, slots=True)
class SyntheticDataConfig:
    """Generate a deterministic synthetic dataset if `dataset_path` is missing."""

    kind: str | None = _f(
        None,
        "A kind of `lmms_data.SYNTHETIC_KINDS`; a family with demo data of its own registers "
        "its kind there (the family's docs page names it). `shapes`: coloured "
        "shapes with class labels, `clips`: moving-shape clips with captions (diffusion "
        "transformers: `lmms_data.generate_synthetic_shapes` / `_clips`; the default for sit / "
        "wan); "
        "`vl`: coloured-shape images with questions (`lmms_data.generate_synthetic_vl`); `text`: "
        "text-only chats (sums, copy, reverse; `generate_synthetic_text`); `audio`: tone "
        '"digits" with questions (`generate_synthetic_audio`); `omni`: half of each of `vl` '
        "and `audio` (`generate_synthetic_omni`); `preference`: `vl` pictures with a right "
        "(chosen) and a wrong (rejected) answer, for `objective: dpo` with `dataset_type: "
        "preference` (`generate_synthetic_preference`, Parquet). Default: `omni` for models "
        "that take images "
        "and audio, `audio` for audio models, `vl` for vision-language models, `text` for "
        "text-only ones.",
    )
    num_samples: int = _f(256, "Number of records to generate.")
    format: Literal["parquet", "jsonl"] = _f("parquet", "File format of the generated dataset.")
    seed: int = _f(0, "Seed of the generator (same seed, same files).")
    image_size: int = _f(64, "Side of the generated square images, in pixels (`vl` only).")


@dataclass(kw_only=True, slots=True)
class DatasetConfig:
    """Where the data is and how samples become packed micro-batches.

    All keys except `eval_dataset_path` and `generate_synthetic` are those of
    `lmms_data.DatasetConfig` and are passed to it unchanged (the processor family and folder
    default to the model's). A test checks that every `lmms_data.DatasetConfig` key is here.
    """

    dataset_type: str = _f(
        "chat",
        "Record adapter from the `lmms_data` dataset registry (`chat`: messages/LLaVA records).",
    )
    dataset_path: str | list[str] = _f(
        "",
        "File, folder or glob of record shards, or a Hub dataset id (`org/name[@revision]`: its "
        "data files, once, into the HF cache), or a list of them (a mixture) (required).",
    )
    dataset_format: str | None = _f(
        None,
        "`jsonl`, `json` (one JSON array of records, or JSON Lines: sniffed), `parquet`, `arrow` "
        "or `hf`; default: from the file extension.",
    )
    data_folder: str | None = _f(
        None, "Base folder of relative media paths in records (default: the shard's folder)."
    )
    allow_absolute_paths: bool = _f(
        False, "Allow media paths that are absolute or escape `data_folder`."
    )
    mixture_weights: list[float] | None = _f(
        None, "Sampling weight per `dataset_path` entry of a mixture."
    )
    processor_family: str | None = _f(
        None, "Processor from the `lmms_data` registry (default: the model family's)."
    )
    processor_path: str | None = _f(
        None, "Tokenizer/processor folder or Hub id (default: `model_config.processor_path`)."
    )
    packing: bool = _f(True, "Pack several samples into one padding-free row (micro-batch).")
    packing_strategy: str = _f(
        "first_fit", "Streaming bin-packing strategy of `lmms_pack` (e.g. `first_fit`, `best_fit`)."
    )
    packing_length: int = _f(
        4096,
        "Tokens per packed row (the micro-batch size in tokens). A longer text-pretraining "
        "document is split into chunks of this length (docs/data.md); any other longer sample "
        "is a bad record of reason `too_long`: skipped and counted, or a clear error with "
        "`bad_record_policy: raise`.",
    )
    max_open_bins: int = _f(
        8, "Open bins kept by the streaming packer (memory O(bins), never O(dataset))."
    )
    max_vision_tokens_per_pack: int | None = _f(
        None,
        "At most this many vision tokens per pack (a second packing budget; a sample over it "
        "takes a pack's whole budget): every data-parallel rank's vision work per pack stays "
        "bounded, see the metric `perf/vision_flops_imbalance`. Unset: no limit.",
    )
    vision_balance_window: int = _f(
        0,
        "Packs each data-parallel rank's loader looks ahead to balance vision FLOPs across the "
        "ranks of a step (no communication: every rank emits the pack at the same quantile of "
        "its window's vision FLOPs, by the family's formula; a pack waits at most 4x this many "
        "steps; exact resume). Lowers `perf/vision_flops_imbalance` on mixed video/image/text "
        "data; costs this many packs of host memory. 0: packs in produced order.",
    )
    bad_record_policy: str = _f(
        "skip",
        "Unreadable/invalid/too long records: `skip` (counted, reported) or `raise` (stop at the "
        "first, naming its reason and file location).",
    )
    max_bad_record_ratio: float = _f(
        0.1, "Abort when bad records exceed this fraction of those seen..."
    )
    min_records_for_ratio: int = _f(200, "...once at least this many records were seen.")
    shuffle: bool = _f(True, "Shuffle shards and records (seeded).")
    shuffle_buffer: int = _f(256, "Records held for local shuffling (0: no buffer).")
    seed: int = _f(0, "Seed of the data order.")
    num_workers: int = _f(2, "Data loader worker processes per rank (0: in the main process).")
    num_epochs: int | None = _f(
        None, "Passes over the data; `null` repeats forever (runs are `max_steps`-driven)."
    )
    min_pixels: int = _f(56 * 56, "Lower bound on pixels per image (resized up).")
    max_pixels: int = _f(28 * 28 * 1280, "Upper bound on pixels per image (resized down).")
    video_min_pixels: int = _f(128 * 28 * 28, "Lower bound on pixels per video frame.")
    video_max_pixels: int = _f(768 * 28 * 28, "Upper bound on pixels per video frame.")
    video_fps: float = _f(2.0, "Frames per second sampled from videos.")
    video_max_frames: int = _f(32, "Most frames sampled from one video.")
    prefetch_factor: int = _f(2, "Packs prefetched per data loader worker.")
    extra: dict[str, Any] = _f(
        {}, "Extra keyword arguments for custom dataset adapters/processors."
    )
    # trainer-owned keys
    eval_dataset_path: str | list[str] | None = _f(
        None, "Held-out records for the periodic validation loss (`trainer_args.eval_steps`)."
    )
    generate_synthetic: SyntheticDataConfig | None = _f(
        None,
        "If set and `dataset_path` does not exist, generate the synthetic demo dataset there first.",
    )


_Schedule = Literal["constant", "linear", "cosine", "wsd"]


@dataclass(kw_only=True, slots=True)
class TrainerArgs:
    """How to train: steps, optimizer, schedule, parallelism, kernels, logging, checkpoints."""

    output_dir: str = _f("runs/default", "Run folder: config.yaml, metrics.jsonl, checkpoints/.")
    run_name: str | None = _f(
        None, "Name shown in wandb/TensorBoard (default: output folder name)."
    )
    seed: int = _f(42, "Seed of model init, data order and dropout.")
    max_steps: int = _f(
        100,
        "Optimizer steps to train for (the run length). `-1`: until `dataset_config.num_epochs` "
        "passes over the data end (the LR schedule is then warmup, then constant).",
    )
    gradient_accumulation_steps: int = _f(
        1, "Micro-batches (packs) per rank per optimizer step; gradients sync once per step."
    )
    # optimizer
    optimizer: Literal["adamw", "muon"] = _f(
        "adamw", "`adamw`, or `muon` (Muon on hidden matrices, AdamW on the rest)."
    )
    learning_rate: float = _f(1e-5, "Peak learning rate (AdamW, and Muon's AdamW groups).")
    muon_learning_rate: float | None = _f(
        None, "Peak learning rate of Muon's matrix parameters (default: `learning_rate`)."
    )
    muon_momentum: float = _f(0.95, "Muon momentum.")
    weight_decay: float = _f(0.0, "Decoupled weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0 disables clipping).")
    ema_decay: float | None = _f(
        None,
        "Keep an exponential moving average of the weights with this decay (e.g. 0.9999; "
        "null: none). Sharded like the weights, saved and resumed with the optimizer state, "
        "exported to `<output_dir>/hf_ema/` next to `hf/`.",
    )
    optimizer_state_dtype: Literal["float32", "bfloat16"] = _f(
        "float32",
        "AdamW's moments: `bfloat16` keeps `exp_avg` and `exp_avg_sq` in bf16, updated in fp32 "
        "and rounded stochastically (`lmms_optim.LowPrecisionAdamW`; draws seeded by `seed`, "
        "so a resume is exact): 12 instead of 16 bytes per trainable parameter on one process "
        "with fp32 masters (what makes a 7B VL model's full fine-tuning fit one 141 GB GPU; "
        "`benchmarks/optim/memory_fit.py`). Convergence against fp32 state: "
        "`benchmarks/optim/bench_state_precision.py` (benchmarks/RESULTS.md). AdamW only.",
    )
    fused_master_step: bool = _f(
        True,
        "AdamW on one process with fp32 masters: clip, update and bf16 write-back in one Triton "
        "kernel per weight matrix (`lmms_optim.MasterAdamW`) instead of three passes, reading a "
        "single micro-batch's gradients in bf16. Same optimizer state and checkpoints; on CPU "
        "bit-identical to `false` (torch's AdamW). H200: -18 ms per 3B text step, -22 ms per "
        "VL 16k step (benchmarks/RESULTS.md).",
    )
    muon_fused_step: bool = _f(
        True,
        "`optimizer: muon` on one process with fp32 masters: `lmms_optim.MasterMuon` instead of "
        "`Muon` + clip + copy: per Muon matrix one Triton kernel for clip, momentum, the bf16 NS "
        "input and its norm, one for the update and the bf16 write-back (the AdamW side as "
        "`fused_master_step`), reading a single micro-batch's gradients in bf16. Same optimizer "
        "state and checkpoints; on CPU bit-identical to `false`. H200: the 3B-shaped Muon step "
        "214 vs 240 ms alone; VL 32k Muon step 2.000 s (three passes: 2.046 s, another machine) "
        "(benchmarks/RESULTS.md).",
    )
    # schedule
    lr_scheduler_type: _Schedule = _f(
        "cosine", "`constant`, `linear` (to min), `cosine` (to min) or `wsd` (warmup-stable-decay)."
    )
    warmup_steps: int = _f(0, "Linear warmup steps from 0 to the peak learning rate.")
    warmup_ratio: float = _f(
        0.0, "Warmup as a fraction of `max_steps` (used if `warmup_steps` is 0)."
    )
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of the peak.")
    wsd_decay_ratio: float = _f(0.1, "WSD: fraction of `max_steps` spent in the final decay.")
    # model dtype and kernels
    bf16: bool = _f(True, "bf16 mixed precision (fp32 master weights, bf16 compute, fp32 reduce).")
    use_rmpad: bool = _f(
        True,
        "Padding-free attention over packed rows (varlen, honours `cu_seqlens`); needed by packing.",
    )
    use_liger_kernel: bool = _f(False, "Swap in Liger's fused kernels (GPU).")
    loss_backend: str = _f(
        "auto",
        "Fused linear cross-entropy of `lmms_kernels` (`auto`: `triton` on CUDA, `torch` "
        "elsewhere; or `liger`, `triton`, `torch`). Liger reads the device three times per step "
        "(a host synchronisation each); `triton` and `torch` never do.",
    )
    loss_rows: Literal["all", "labelled"] = _f(
        "all",
        "`labelled`: the LM head and the loss run only on the rows whose (shifted) label is not "
        "ignored (prompt, image and padding rows skipped: about half of a VL pack); the rows are "
        "found on the host from the pack's labels, so no device sync. Same loss and gradients as "
        "`all` up to the order of fp32 sums (tests). MFU then counts the head on those rows only "
        "(`mfu`); `mfu_all_rows` keeps the every-row count. Causal LM without SP or TP only "
        "(masked diffusion, SP and TP runs take every row).",
    )
    gc_control: bool = _f(
        True,
        "No garbage-collection pauses in steady state: after step 1 one full collection and "
        "`gc.freeze()`, automatic collection off, the young generations collected at each step "
        "boundary while the device runs the step, a full collection at save/eval steps and every "
        "`gc_full_collect_steps` (`lmms_train._gc_clock`). `false`: Python's own collector.",
    )
    gc_full_collect_steps: int = _f(
        200, "With `gc_control`: a full collection every this many steps (0: only at save/eval)."
    )
    compile_warmup: bool = _f(
        True,
        "With `compile: true`: before step 1, one forward/backward of the first pack (gradients "
        "discarded, RNG restored) and every attention signature replayed at the segment counts "
        "where FA4 switches kernels, so no step after it compiles (`lmms_train._warmup`).",
    )
    attn_backend: str = _f(
        "auto",
        "Varlen attention backend of `lmms_kernels` (`auto`, `fa4`, `fa`, `torch`, `flex`, `sdpa`).",
    )
    vision_attn_backend: str | None = _f(
        None,
        "The vision tower's own attention backend (same choices; unset: `attn_backend`). `torch` "
        "(aten flash attention) takes head dim 80 unpadded: 3 GiB less than `fa4` at Qwen2.5-VL "
        "16k, the same speed within the run-to-run spread (benchmarks/RESULTS.md).",
    )
    linear_patch_embed: bool = _f(
        False,
        "Run the vision tower's patch embedding (a Conv3d with one window per patch) as one GEMM "
        "(`lmms_models.linear_patch_embed`; same parameters and checkpoints) instead of through "
        "cuDNN, which chooses an engine for every new patch count. Not yet measured on a GPU "
        "(benchmarks/models/NOTES.md, item 31).",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = _f(
        "none",
        "Recompute activations per decoder block in backward to save memory: `full` (keep only "
        "the block input), `selective` (keep matmul/attention outputs) or `none`.",
    )
    activation_checkpointing_fraction: float = _f(
        1.0,
        "Fraction of decoder blocks checkpointed, in [0, 1], spread evenly (0.5: every other "
        "block, the measured layout); also of the vision blocks with "
        "`vision_activation_checkpointing: same`.",
    )
    vision_activation_checkpointing: Literal["same", "none", "full", "selective"] = _f(
        "same",
        "Vision blocks: `same` (decoder mode and fraction) or their own mode on every vision "
        "block (`none` measured fastest at 16k on an H200).",
    )
    vision_activation_checkpointing_fraction: float = _f(
        1.0,
        "Fraction of vision blocks checkpointed, in [0, 1], spread evenly, when "
        "`vision_activation_checkpointing` names its own mode (with `same` the decoder's "
        "fraction applies). At 32k tokens on an H200, `full` with 0.5 here and the decoder fully "
        "checkpointed was measured 8.9% faster than checkpointing every block.",
    )
    memory: Literal["check", "auto", "off"] = _f(
        "check",
        "Memory plan before the model is built (`lmms-train plan` prints it): `check` stops a "
        "run whose predicted peak does not fit the GPU, with the plan and the settings that "
        "would make it fit; `auto` picks the fastest layout that fits (activation-checkpointing "
        "fractions of the decoder and vision blocks, `optimizer_state_dtype`, `fsdp_cpu_offload` "
        "as the last resort) and logs it; `off` skips the plan.",
    )
    memory_media_share: float = _f(
        0.5,
        "The memory plan's share of media placeholder tokens in a pack (images, video, audio: "
        "their encoder runs tokens_per_media_token tokens for each); in [0, 1].",
    )
    compile: bool = _f(
        False,
        "`torch.compile` each decoder and vision block (Inductor, dynamic shapes: new pack "
        "lengths do not recompile), after activation checkpointing and before FSDP. The first "
        "step pays the compilation (about a minute on a GPU for a 3B model; slower on CPU).",
    )
    freeze: list[str] = _f(
        [],
        "Modules to freeze: `vision_tower`, `embeddings`, `lm_head`, `language_model`, or module path prefixes.",
    )
    # parallelism
    sp_ulysses_degree: int = _f(
        1, "Ulysses sequence-parallel degree (ranks sharing one packed row)."
    )
    sp_split_vision: bool = _f(
        True,
        "Under Ulysses SP, each rank of the group encodes a FLOPs-balanced share of the pack's "
        "images and frames and the features are all-gathered (`lmms_parallel.SplitVision`); false: "
        "every rank runs the vision tower on the whole pack.",
    )
    dp_replicate: int = _f(
        1, "Replicated data-parallel degree (HSDP across groups); 1 = pure FSDP."
    )
    tp_degree: int = _f(
        1,
        "Tensor-parallel degree: the family's TP plan (attention and SwiGLU column/row-wise; "
        "Qwen2/2.5(-VL), Qwen3(-VL)) on this many neighbouring ranks, which read the same packs; "
        "FSDP2 shards over the rest. The LM head is split over the vocabulary and the loss is "
        "vocab-parallel (never [T, vocab]; `causal_lm`, untied head). Must divide the attention "
        "and KV heads and the vocabulary; not together with `sp_ulysses_degree` or `ep_degree` "
        "> 1. Checkpoints resume, also at another degree.",
    )
    tp_sequence_parallel: bool = _f(
        False,
        "With `tp_degree` > 1: sequence-parallel norms (Megatron SP): between the attention and "
        "MLP sub-blocks each TP rank holds its share of the tokens (norms and residuals on "
        "T/tp tokens; all-gather before q/k/v and gate/up, reduce-scatter after o/down). "
        "Families with `tp_sp_plan`: Qwen2/2.5, Qwen2.5-VL, Qwen3, Qwen3-VL (deepstack added "
        "on each rank's rows).",
    )
    ep_degree: int = _f(
        1,
        "Expert-parallel degree (MoE families): each group of this many data-parallel ranks "
        "splits the experts and exchanges tokens by all-to-all (dropless); must divide the "
        "experts and `world / (dp_replicate * tp_degree)`. Checkpoints save and resume under "
        "EP, also at another EP degree or world size (docs/parallel.md).",
    )
    experts_backend: str = _f(
        "grouped",
        "MoE experts: `grouped` (lmms-kernels: sorted tokens, one grouped GEMM per projection, "
        "no per-expert loop), `loop` (its plain-torch reference), or a transformers experts "
        "implementation (`eager`: upstream's per-expert loop, `grouped_mm`, `batched_mm`).",
    )
    fsdp: bool | None = _f(
        None,
        "Shard parameters, gradients and optimizer state with FSDP2. Unset: FSDP2 on several "
        "processes; on one, a module computing in bf16 with fp32 master weights in the optimizer "
        "(`lmms_parallel.MasterWeights`: the same numbers without FSDP2's one-rank copies, +8% "
        "tok/s for a 3B model on an H200), or FSDP2 when `fsdp_cpu_offload` is set. `true` forces "
        "FSDP2 on one process too; `false` is for one process only.",
    )
    reshard_after_forward: bool = _f(
        True, "FSDP2: free gathered parameters after forward (ZeRO-3)."
    )
    fsdp_cpu_offload: bool = _f(
        False,
        "FSDP2: keep sharded parameters, gradients and optimizer state in host memory (slow; "
        "for models that do not fit otherwise).",
    )
    frozen_encoders: Literal["replicate", "shard", "offload"] = _f(
        "replicate",
        "Diffusion families with on-the-fly encoding (wan's umT5): `replicate` a full copy on "
        "every rank; `shard` FSDP2 per block over the FSDP ranks (needs `fsdp`; bf16 weights "
        "when `bf16`); `offload` weights in CPU memory, each block moved in for its forward. "
        "See docs/diffusion.md.",
    )
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "`auto`: CUDA if available, else CPU.")
    # evaluation
    eval_steps: int = _f(
        0, "Validation loss every this many steps (0: never; needs `eval_dataset_path`)."
    )
    eval_batches: int = _f(8, "Packed rows per rank per validation.")
    # checkpoints
    save_steps: int = _f(0, "Checkpoint every this many steps (0: only at the end and on SIGTERM).")
    save_total_limit: int = _f(3, "Keep the last this many checkpoints.")
    save_final: bool = _f(True, "Write a checkpoint at the end of training.")
    export_hf: bool = _f(
        False,
        "At the end, write `output_dir/hf`: config, safetensors weights, tokenizer, processor and "
        "chat template, loadable with `AutoProcessor` and the model's Auto class.",
    )
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto",
        "dtype of the exported weights: `auto` keeps the masters' (fp32 for a bf16 run); "
        "`bfloat16` halves the folder (config.json names the dtype written).",
    )
    resume_from: str | None = _f(
        None,
        "`latest` (error if none), `auto` (latest if any), or a checkpoint folder. `latest` is "
        "the newest checkpoint of the run `output_dir` holds (its `run.json` lineage).",
    )
    overwrite_output_dir: bool = _f(
        False,
        "A fresh run (no `resume_from`) into an `output_dir` that holds another run "
        "(checkpoints/step_*, a metrics.jsonl with steps) is refused; `true` replaces that run: "
        "once the model is built, its checkpoints, metrics, plot, config, exports (hf/, "
        "hf_ema/) and TensorBoard/wandb logs are deleted (other files stay).",
    )
    on_data_change: Literal["error", "restart"] = _f(
        "error",
        "Resuming when the dataset files differ from those the checkpoint recorded (names, "
        "sizes, row counts): `error` names what changed; `restart` loads model and optimizer and "
        "restarts the data order from the dataset's seed.",
    )
    # divergence guard
    on_nonfinite: Literal["stop", "skip"] = _f(
        "stop",
        "A non-finite loss or gradient norm: `stop` (one line naming the step, the quantity and "
        "the last good checkpoint; nothing is saved) or `skip` (the step's update is dropped and "
        "counted in `skipped_steps`; costs one host synchronisation per step).",
    )
    max_nonfinite_skips: int = _f(
        10, "`on_nonfinite: skip`: stop anyway after this many skipped steps in a row."
    )
    # metrics
    report_to: list[str] = _f(
        ["console"],
        "Metric sinks besides metrics.jsonl (always): `console`, `wandb`, `tensorboard`.",
    )
    wandb_project: str = _f("lmms", "wandb project.")
    wandb_mode: Literal["offline", "online"] = _f("offline", "wandb mode (offline unless set).")
    peak_flops: float | None = _f(
        None, "Peak FLOP/s of one device for MFU (default: from the device table)."
    )
    logging_steps: int = _f(
        1, "Print to the console every this many steps (JSONL gets every step)."
    )
    profile_steps: list[int] = _f(
        [],
        "`[first, last]`: run torch.profiler from step `first` through step `last` and write, "
        "under `output_dir/profile/`, the trace (Perfetto), an operator table and where the host "
        "waited for the device (`syncs_rank*.json`: count, time and call site of each wait). "
        "Empty: off.",
    )
    profile_step_breakdown: bool = _f(
        False,
        "Log `time/forward`, `time/backward` and `time/optimizer` per step (CUDA events, read "
        "after the step's own synchronisation: no extra host sync).",
    )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The whole run: `model_config`, `dataset_config`, `trainer_args`."""

    model_config: ModelConfig = field(
        default_factory=ModelConfig, metadata={"doc": "What model to train."}
    )
    dataset_config: DatasetConfig = field(
        default_factory=DatasetConfig, metadata={"doc": "Data and packing."}
    )
    trainer_args: TrainerArgs = field(
        default_factory=TrainerArgs, metadata={"doc": "Training, parallelism, logging."}
    )
