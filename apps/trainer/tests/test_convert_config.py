"""lmms-engine configs (both of its shapes, HF TrainingArguments dumped whole, inline and external
data lists) become valid lmms-train configs; every key is mapped, dropped with a reason, or a
problem naming its new home; the key map page documents every key the converter knows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lmms_train._convert_config import convert, looks_like_lmms_engine, render
from lmms_train._convert_tables import (
    _HF_DEFAULT_ONLY,
    _HF_IGNORED,
    _LIGER_TOGGLES,
    _SAME,
    _SAME_AS_OURS,
    _TRAINERS,
    _VIDEO_EXTRA,
    engine_model_types,
)
from lmms_train.config import config_from_dict

REPO = Path(__file__).resolve().parents[3]

# Written the way lmms-engine's example configs are: dict form, the processor block, an inline
# data list, HF TrainingArguments dumped with their defaults, FSDP2 and parallel degrees.
ENGINE_DICT = """
trainer_type: fsdp2_trainer
dataset_config:
  dataset_type: vision_iterable
  dataset_format: yaml
  datasets:
    - path: data/captions.json
      data_folder: media
      data_type: json
    - path: data/chat.parquet
      data_folder: media
      data_type: parquet
  processor_config:
    processor_name: ckpt/qwen25vl
    processor_type: qwen2_5_vl
  packing: true
  packing_strategy: first_fit
  packing_length: 8192
  filter_overlong: true
  video_backend: qwen_vl_utils
  video_sampling_strategy: fps
  fps: 2
  frame_num: 32
  video_max_pixels: 50176
  object_storage: none
  bucket_name: null
  extra_kwargs: {}
model_config:
  load_from_pretrained_path: ckpt/qwen25vl
  attn_implementation: flash_attention_2
  monkey_patch_kwargs:
    patch_type: [liger]
    fused_linear_cross_entropy: true
    rms_norm: false
trainer_args:
  output_dir: ./output/run1
  overwrite_output_dir: false
  do_train: false
  eval_strategy: 'no'
  per_device_train_batch_size: 2
  per_device_eval_batch_size: 8
  gradient_accumulation_steps: 4
  learning_rate: 2.0e-05
  weight_decay: 0.1
  max_grad_norm: 1.0
  num_train_epochs: 1
  max_steps: 3000
  lr_scheduler_type: cosine_with_min_lr
  lr_scheduler_kwargs: {min_lr_rate: 0.1}
  warmup_ratio: 0.03
  logging_dir: ./output/run1/runs/Dec05_00-00-00_host
  logging_steps: 10
  save_strategy: steps
  save_steps: 500
  save_total_limit: 2
  seed: 7
  data_seed: null
  bf16: true
  fp16: false
  local_rank: 0
  dataloader_num_workers: 4
  dataloader_prefetch_factor: null
  run_name: run1
  fsdp: []
  fsdp_min_num_params: 0
  fsdp_config:
    transformer_layer_cls_to_wrap: [Qwen2_5_VLDecoderLayer]
    reshard_after_forward: false
    min_num_params: 0
  deepspeed: null
  optim: adamw_torch_fused
  report_to: wandb
  hub_token: <HUB_TOKEN>
  push_to_hub: false
  gradient_checkpointing: true
  gradient_checkpointing_kwargs: null
  ddp_timeout: 1800
  torch_compile: false
  use_liger_kernel: true
  use_muon: false
  freeze_modules: [visual]
  use_rmpad: true
  fsdp2: true
  sp_ulysses_degree: 2
  ep_degree: 1
  tp_degree: 1
  reduce_dtype: bfloat16
  output_dtype: bfloat16
  print_batch_input_steps: 5
  enable_profiler: false
  profiler_config: {start_step: 1, end_step: 3}
extra_kwargs: null
"""

# The older list form: trainer arguments flat under `config`, an external data-list YAML.
ENGINE_LIST = """
- type: trainer
  config:
    trainer_type: fsdp2_trainer
    dataset_config:
      dataset_type: vision
      dataset_format: yaml
      dataset_path: lists/mix.yaml
      processor_config: {processor_name: ckpt/qwen3, processor_type: qwen3}
      packing: false
    model_config:
      load_from_pretrained_path: ckpt/qwen3
    per_device_train_batch_size: 1
    learning_rate: 1.0e-06
    gradient_checkpointing: false
    max_steps: 50
    report_to: none
    output_dir: ./output/list
    lr_scheduler_type: constant
    use_muon: true
    ep_degree: 4
"""
DATA_LIST = """
datasets:
  - json_path: /data/llava_v1_5_mix665k.json
    sampling_strategy: all
  - json_path: /data/sharegpt4v.json
    sampling_strategy: "all"
"""


def test_dict_form_maps_every_common_key():
    raw = yaml.safe_load(ENGINE_DICT)
    assert looks_like_lmms_engine(raw)
    conv = convert(raw)
    assert conv.problems == []
    c = conv.config
    assert c["model_config"] == {
        "load_from_pretrained_path": "ckpt/qwen25vl", "processor_path": "ckpt/qwen25vl"
    }  # fmt: skip
    d, t = c["dataset_config"], c["trainer_args"]
    assert d["dataset_path"] == ["data/captions.json", "data/chat.parquet"]
    assert d["data_folder"] == "media" and d["dataset_type"] == "chat"
    assert d["processor_family"] == "qwen2_5_vl" and d["num_workers"] == 4
    assert d["video_fps"] == 2 and d["video_max_pixels"] == 50176
    assert "dataset_format" not in d and "num_epochs" not in d  # max_steps wins over epochs
    assert t["gradient_accumulation_steps"] == 8  # 2 per device x 4 accumulation
    assert t["activation_checkpointing"] == "full" and t["reshard_after_forward"] is False
    assert t["lr_scheduler_type"] == "cosine" and t["min_lr_ratio"] == 0.1
    assert t["attn_backend"] == "auto" and t["use_liger_kernel"] is True
    assert t["report_to"] == ["console", "wandb"] and t["freeze"] == ["vision_tower"]
    assert t["max_steps"] == 3000 and t["save_steps"] == 500 and t["optimizer"] == "adamw"
    assert t["sp_ulysses_degree"] == 2 and t["ep_degree"] == 1 and t["tp_degree"] == 1
    notes = "\n".join(conv.notes)
    for key in ("trainer_type", "fsdp2", "video_backend", "filter_overlong", "reduce_dtype",
                "fsdp_config.transformer_layer_cls_to_wrap", "HF Trainer bookkeeping"):  # fmt: skip
        assert key in notes, key
    assert {"logging_dir", "local_rank", "hub_token", "ddp_timeout"} <= set(conv.dropped_hf)
    # the result is an lmms-train config: it validates (ParallelDims keys permitting)
    if not _has_parallel_degrees():
        for k in ("ep_degree", "tp_degree"):
            t.pop(k)
    config_from_dict(c)
    text = render(conv, "engine.yaml")
    assert yaml.safe_load(text) == c and text.startswith("# converted from")


def test_list_form_and_external_data_list(tmp_path):
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "mix.yaml").write_text(DATA_LIST)
    raw = yaml.safe_load(ENGINE_LIST)
    assert looks_like_lmms_engine(raw)
    conv = convert(raw, base=tmp_path)
    assert conv.problems == []
    d, t = conv.config["dataset_config"], conv.config["trainer_args"]
    assert d["dataset_path"] == ["/data/llava_v1_5_mix665k.json", "/data/sharegpt4v.json"]
    assert d["packing"] is False and d["processor_family"] == "qwen3"
    assert t["optimizer"] == "muon" and t["activation_checkpointing"] == "none"
    assert t["report_to"] == ["console"] and t["lr_scheduler_type"] == "constant"
    assert t["ep_degree"] == 4 and t["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize(
    ("patch", "expect"),
    [
        ({"trainer_args": {"fp16": True}}, "trainer_args.fp16: True cannot be converted: lmms-train computes in bf16"),
        ({"trainer_args": {"torch_compile_backend": "cudagraphs"}}, "compiles with Inductor"),
        ({"model_config": {"torch_dtype": "float16"}}, "model_config.torch_dtype: 'float16' cannot be converted: the weights load in fp32"),
        ({"trainer_args": {"optim": "sgd"}}, "adamw or muon"),
        ({"trainer_args": {"lr_scheduler_type": "polynomial"}}, "trainer_args.lr_scheduler_type"),
        ({"trainer_args": {"leraning_rate": 1e-5}}, "did you mean 'learning_rate'?"),
        ({"dataset_config": {"dataset_type": "bagel"}}, "register_dataset"),
        ({"dataset_config": {"object_storage": "gcs"}}, "local or mounted files"),
        ({"model_config": {"overwrite_config": {"rope_theta": 1e6}}}, "config.json"),
        ({"trainer_type": "grpo_trainer"}, "other trainers (RL, ...) are not ported"),
    ],
)  # fmt: skip
def test_problems_name_the_new_home(patch, expect):
    raw = yaml.safe_load(ENGINE_DICT)
    for section, value in patch.items():
        if isinstance(value, dict):
            raw[section].update(value)
        else:
            raw[section] = value
    problems = convert(raw).problems
    assert len(problems) == 1, problems
    assert expect in problems[0] and "docs/migrating-from-lmms-engine.md" in problems[0]
    assert "\n" not in problems[0]


def test_sampling_strategy_and_mixed_folders_are_problems():
    raw = yaml.safe_load(ENGINE_DICT)
    raw["dataset_config"]["datasets"][0]["sampling_strategy"] = "first:10%"
    raw["dataset_config"]["datasets"][1]["data_folder"] = "other"
    problems = convert(raw).problems
    assert any("mixture_weights" in p for p in problems)
    assert any("one dataset_config.data_folder" in p for p in problems)


def test_lmms_train_configs_are_not_mistaken_and_pass_through():
    """Native configs are not taken for lmms-engine ones; one lmms-engine key added by habit
    converts the file with every native key kept as it was."""
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        assert not looks_like_lmms_engine(raw), path
        t = raw.setdefault("trainer_args", {})
        ga = t.get("gradient_accumulation_steps", 1)
        mixed = {**raw, "trainer_args": {**t, "per_device_train_batch_size": 2}}
        conv = convert(mixed)
        assert conv.problems == [], (path, conv.problems)
        want = {s: dict(v) for s, v in raw.items() if v}
        want["trainer_args"]["gradient_accumulation_steps"] = 2 * ga
        assert conv.config == want, path


def test_key_map_page_lists_every_key():
    page = (REPO / "docs" / "migrating-from-lmms-engine.md").read_text()
    named = set(re.findall(r"`([a-z_0-9.]+)`", page))
    keys = {*_SAME, *_HF_DEFAULT_ONLY, "per_device_train_batch_size", "num_train_epochs",
            "dataloader_num_workers", "gradient_checkpointing", "fsdp2", "fsdp_config",
            "attn_implementation", "processor_config", "datasets", "dataset_format",
            "trainer_type", "ep_degree", "tp_degree", "freeze_modules", "use_muon", "optim",
            "monkey_patch_kwargs", "overwrite_config", "lr_scheduler_type", "report_to",
            "resume_from_checkpoint", "enable_profiler", "sampling_strategy", "video_backend",
            "filter_overlong", "dataset_type", "torch_compile", "reduce_dtype",
            *_SAME_AS_OURS, *_LIGER_TOGGLES, *_TRAINERS, *engine_model_types(), *_VIDEO_EXTRA,
            "fineweb_edu", "deepspeed"}  # fmt: skip
    missing = sorted(k for k in keys if k not in named)
    assert not missing, f"keys the converter handles but the page does not name: {missing}"
    assert "HF Trainer bookkeeping" in page and len(_HF_IGNORED) > 60


def _has_parallel_degrees() -> bool:
    from lmms_train.config import TrainerArgs

    return {"ep_degree", "tp_degree"} <= set(TrainerArgs.__dataclass_fields__)
