"""lmms-engine's own example configs (issue 34): each shape converts with no problem and trains
on the CPU with tiny overrides, over local tiny model folders (the family's tiny config saved
with `save_pretrained`) and generated data. The YAMLs are written here with the keys of
lmms-engine's files (examples/qwen3_moe/qwen3_moe_ep8.yaml, examples/qwen3_vl/example_config.yaml
with its data-list YAML, examples/llava_video/llava_video_qwen2_7b.yaml,
examples/dllm_train_example.yaml), Hub ids and cluster paths replaced by local folders.

Tiny overrides (command-line keys after the config): `trainer_args.max_steps` of a few steps,
`bf16=false`, `ep_degree=1` (one process), `attn_backend=sdpa` on the CPU, small packing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lmms_train._convert_config import convert
from lmms_train._metrics import read_jsonl
from lmms_train.cli import main

CPU = ["trainer_args.bf16=false", "trainer_args.attn_backend=sdpa", "trainer_args.report_to=[]",
       "trainer_args.save_steps=0", "trainer_args.use_liger_kernel=false",
       "trainer_args.activation_checkpointing=none"]  # fmt: skip


def _tiny_folder(root: Path, family: str, processor_family: str, **config) -> tuple[str, str]:
    """A tiny model of `family` saved with save_pretrained (its token ids those of a local
    processor of `processor_family`, built next to it); returns (model folder, processor)."""
    from lmms_data import build_local_processor
    from lmms_models import get_model_spec
    from lmms_train._data_setup import _token_ids
    from lmms_train._model_setup import model_config_dict
    from lmms_train.config import config_from_dict

    spec = get_model_spec(family)
    proc = root / "processor"
    build_local_processor(str(proc), processor_family)
    lfc = {"model_type": family, "tiny": True, "config": config}
    cfg = config_from_dict({"model_config": {"load_from_config": lfc},
                            "dataset_config": {"dataset_path": str(root)}})  # fmt: skip
    conf = model_config_dict(cfg, spec, _token_ids(str(proc), vision=bool(spec.media_keys)))
    spec.build(config=conf).save_pretrained(root / "model")
    return str(root / "model"), str(proc)


def _convert_clean(path: Path) -> dict:
    conv = convert(yaml.safe_load(path.read_text()), base=path.parent)
    assert conv.problems == [], conv.problems
    return conv


def _train(path: Path, *overrides: str, capsys) -> str:
    code = main([str(path), *CPU, *overrides])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    return err


def _engine_trainer_args(**over) -> dict:
    """The HF TrainingArguments dump lmms-engine writes into its example configs (every key at
    its default), with lmms-engine's own trainer keys."""
    from transformers import TrainingArguments

    dump = TrainingArguments(output_dir="x").to_dict()
    dump = {k: v for k, v in dump.items() if isinstance(v, str | int | float | bool | list | dict)
            or v is None}  # fmt: skip
    dump.update(use_liger_kernel=True, use_muon=False, freeze_modules=None, use_rmpad=True,
                fsdp2=True, sp_ulysses_degree=1, reduce_dtype="bfloat16", output_dtype="bfloat16",
                print_batch_input_steps=5, enable_profiler=False,
                profiler_config={"start_step": 1, "end_step": 3},
                fsdp_config={"transformer_layer_cls_to_wrap": ["Qwen3VLTextDecoderLayer"],
                             "reshard_after_forward": False, "min_num_params": 0, "xla": False})  # fmt: skip
    dump.update(over)
    return dump


def test_qwen3_moe_ep8_shape(tmp_path, capsys):
    """qwen3_moe_ep8.yaml: Qwen3-VL-MoE on a text dataset list, Liger per-kernel switches,
    ep_degree 8 (1 here: one CPU process). Its processor_type qwen2 (a text processor) does not
    fit the Qwen3-VL model: one error line before the model is built; without it, it trains."""
    from lmms_data import generate_synthetic_text

    model, proc = _tiny_folder(tmp_path, "qwen3_vl_moe", "qwen3_vl",
                               vision_config={"patch_size": 16})  # fmt: skip
    generate_synthetic_text(str(tmp_path / "text"), 16)
    cfg = {
        "trainer_type": "fsdp2_trainer",
        "dataset_config": {
            "dataset_type": "vision_iterable", "dataset_format": "yaml",
            "datasets": [{"path": str(tmp_path / "text"), "data_folder": "", "data_type": "parquet"}],
            "processor_config": {"processor_name": proc, "processor_type": "qwen2"},
            "packing": False, "packing_strategy": "first_fit", "packing_length": 512,
            "video_backend": "qwen_vl_utils", "filter_overlong": True,
        },
        "model_config": {
            "load_from_pretrained_path": model, "attn_implementation": "flash_attention_2",
            "monkey_patch_kwargs": {"patch_type": ["liger"], "use_rmpad": True, "rope": False,
                                    "swiglu": False, "cross_entropy": False,
                                    "fused_linear_cross_entropy": True, "rms_norm": False},
        },
        "trainer_args": {
            "per_device_train_batch_size": 1, "learning_rate": 1.0e-06, "weight_decay": 0.0,
            "gradient_accumulation_steps": 1, "gradient_checkpointing": True, "max_steps": 500,
            "num_train_epochs": 1, "save_steps": 100, "save_total_limit": 1, "report_to": "none",
            "output_dir": str(tmp_path / "out"), "warmup_ratio": 0.0, "warmup_steps": 100,
            "run_name": "debug", "eval_strategy": "no", "logging_steps": 1,
            "group_by_length": False, "dataloader_num_workers": 0, "bf16": True,
            "lr_scheduler_type": "constant", "use_liger_kernel": True, "use_rmpad": True,
            "fsdp2": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"],
                                           "reshard_after_forward": False},
            "sp_ulysses_degree": 1, "ep_degree": 8, "enable_profiler": False,
            "profiler_config": {"start_step": 1, "end_step": 3},
        },
    }  # fmt: skip
    path = tmp_path / "qwen3_moe_ep8.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    notes = "\n".join(_convert_clean(path).notes)
    assert "rope: dropped (Liger's RoPE kernel" in notes
    assert "rms_norm: dropped (Liger's RMSNorm kernel" in notes
    tiny = ["trainer_args.ep_degree=1", "trainer_args.max_steps=2"]
    assert main([str(path), *CPU, *tiny]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]
    assert len(lines) == 1 and "'qwen2' does not fit the qwen3_vl_moe model" in lines[0], err
    assert not (tmp_path / "out" / "checkpoints").exists()
    cfg["dataset_config"]["processor_config"].pop("processor_type")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    _train(path, *tiny, capsys=capsys)
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 2


def test_qwen3_vl_example_config_shape(tmp_path, capsys):
    """qwen3_vl/example_config.yaml: the whole HF TrainingArguments dump, a data-list YAML
    (dataset_format: yaml), processor_name '' and processor_type nit (not an lmms_data family:
    the model's own is used)."""
    from lmms_data import generate_synthetic_vl

    model, proc = _tiny_folder(tmp_path, "qwen3_vl", "qwen3_vl", vision_config={"patch_size": 16})
    for name in (
        "preprocessor_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "lmms_processor_info.json",
    ):
        src = Path(proc) / name
        if src.is_file():  # the processor saved with the model, as a Hub folder has it
            (Path(model) / name).write_bytes(src.read_bytes())
    generate_synthetic_vl(str(tmp_path / "data" / "video"), 16, format="parquet", seed=0)
    (tmp_path / "data" / "debug.yaml").write_text(yaml.safe_dump(
        {"datasets": [{"path": str(tmp_path / "data" / "video"), "data_folder": "",
                       "data_type": "parquet"}]}))  # fmt: skip
    cfg = {
        "trainer_type": "fsdp2_trainer",
        "dataset_config": {
            "extra_kwargs": {}, "dataset_type": "qwen3_vl_iterable", "dataset_format": "yaml",
            "processor_config": {"processor_name": "", "processor_type": "nit"},
            "dataset_path": "data/debug.yaml", "datasets": None, "shuffle": True,
            "eval_dataset_path": None, "object_storage": "none", "bucket_name": None,
            "packing": False, "packing_strategy": "first_fit", "packing_length": 51200,
            "filter_overlong": True, "filter_overlong_workers": 8, "max_length": None,
            "video_sampling_strategy": "fps", "video_max_pixels": 50176, "video_max_frames": 512,
            "frame_num": 64, "fps": 1, "video_backend": "qwen_vl_utils",
        },
        "trainer_args": _engine_trainer_args(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, learning_rate=0.0002, max_steps=1000,
            lr_scheduler_type="cosine", warmup_ratio=0.1, save_steps=1000, save_total_limit=1,
            bf16=True, gradient_checkpointing=True, optim="adamw_torch_fused", report_to=[],
            run_name="video_debug"),
        "model_config": {
            "extra_kwargs": {}, "load_from_pretrained_path": model, "load_from_config": None,
            "attn_implementation": "flash_attention_2", "overwrite_config": None,
            "monkey_patch_kwargs": None,
        },
        "extra_kwargs": None,
    }  # fmt: skip
    path = tmp_path / "example_config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    _convert_clean(path)
    _train(path, "trainer_args.max_steps=2", "dataset_config.packing_length=2048",
           "dataset_config.max_pixels=16384", capsys=capsys)  # fmt: skip
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 2


def test_llava_video_qwen2_shape_runs_its_epochs(tmp_path, capsys):
    """llava_video_qwen2_7b.yaml: model_type llava_onevision with torch_dtype bfloat16,
    torch_compile_backend inductor, LLaVA-Video's dataset type, extra_kwargs and slow-fast
    switches, and `num_train_epochs: 1` with `max_steps: -1`: the run ends after the last pass
    over the data (here 2 passes, `dataset_config.num_epochs=2` on the command line: 8 records, 2
    micro-batches a step, 8 steps), with its final checkpoint; after the first pass the console
    estimates the run's length from it."""
    from lmms_data import generate_synthetic_vl

    model, proc = _tiny_folder(tmp_path, "llava_onevision", "llava_onevision")
    generate_synthetic_vl(str(tmp_path / "videos"), 8, format="parquet", seed=0)
    t = _engine_trainer_args(
        output_dir=str(tmp_path / "out"),
        do_train=True,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=1e-5,
        num_train_epochs=1,
        max_steps=-1,
        lr_scheduler_type="cosine",
        warmup_ratio=0.03,
        save_steps=500,
        save_total_limit=1,
        tf32=True,
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        optim="adamw_torch",
        report_to=["tensorboard", "wandb"],
        torch_compile=True,
        torch_compile_backend="inductor",
        gradient_checkpointing=True,
        bf16=True,
    )
    cfg = {
        "trainer_type": "fsdp2_trainer",
        "dataset_config": {
            "dataset_type": "llava_video", "dataset_format": "parquet",
            "processor_config": {"processor_name": proc, "processor_type": "llava_video"},
            "datasets": [{"path": str(tmp_path / "videos"), "data_folder": "",
                          "data_type": "parquet"}],
            "shuffle": True, "eval_dataset_path": None, "object_storage": "none",
            "bucket_name": None, "packing": False, "packing_strategy": "first_fit",
            "packing_length": 32768, "filter_overlong": True, "filter_overlong_workers": 8,
            "max_length": None, "video_sampling_strategy": "fps", "frame_num": 16, "fps": 1,
            "video_backend": "decord",
            "extra_kwargs": {"data_folder": "", "frames_upbound": 16, "force_sample": True,
                             "add_time_instruction": True},
        },
        "trainer_args": t,
        "model_config": {
            "extra_kwargs": {}, "load_from_pretrained_path": model, "load_from_config": None,
            "attn_implementation": "flash_attention_2", "model_type": "llava_onevision",
            "torch_dtype": "bfloat16",
            "monkey_patch_kwargs": {"patch_type": ["video"], "add_faster_video": False,
                                    "faster_token_stride": 10, "mm_spatial_pool_stride": 2,
                                    "mm_spatial_pool_mode": "bilinear"},
        },
        "extra_kwargs": None,
    }  # fmt: skip
    path = tmp_path / "llava_video_qwen2_7b.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    conv = _convert_clean(path)
    notes = "\n".join(conv.notes)
    assert "torch_dtype: dropped ('bfloat16' is what lmms-train does" in notes
    assert "torch_compile_backend: dropped ('inductor' is what lmms-train does" in notes
    assert conv.config["trainer_args"]["max_steps"] == -1
    assert conv.config["dataset_config"]["num_epochs"] == 1
    err = _train(path, "trainer_args.compile=false", "dataset_config.packing_length=4096",
                 "dataset_config.shuffle=false", "dataset_config.num_epochs=2",
                 "trainer_args.report_to=[console]", capsys=capsys)  # fmt: skip
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)), err[-2000:]
    assert sum(r["samples"] for r in rows) == 16  # every record twice
    assert "pass(es) ended after step 8" in err
    first = re.search(r"the first pass over the data took (\d+) steps: about (\d+) steps", err)
    assert (
        first and 4 <= int(first.group(1)) <= 5 and int(first.group(2)) == 2 * int(first.group(1))
    ), err[-3000:]
    assert (tmp_path / "out" / "checkpoints" / "step_000008" / "COMPLETE").is_file()


def test_dllm_train_example_shape(tmp_path, capsys):
    """dllm_train_example.yaml (the older list form): `dllm_trainer` with model_type qwen3_dllm
    is qwen3 with the masked-diffusion objective; fineweb_edu is plain-text pretraining data;
    deepspeed is dropped (FSDP2). Tiny overrides: the model's sizes, its mask token."""
    from lmms_data import build_local_processor

    proc = tmp_path / "processor"
    build_local_processor(str(proc), "qwen3")
    docs = tmp_path / "fineweb"
    docs.mkdir()
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "red", "green", "blue", "birds"]
    with open(docs / "part-0.jsonl", "w") as f:
        for i in range(64):
            f.write(
                json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(20))})
                + "\n"
            )
    config = {
        "trainer_type": "dllm_trainer",
        "dataset_config": {
            "dataset_type": "fineweb_edu", "dataset_format": "hf_dataset",
            "dataset_path": str(docs), "packing_length": 2048,
            "processor_config": {"processor_name": str(proc), "processor_type": "qwen3"},
        },
        "model_config": {
            "attn_implementation": "sdpa",
            "load_from_config": {"model_type": "qwen3_dllm", "config": {
                "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "use_cache": False}},
        },
        "per_device_train_batch_size": 32, "learning_rate": 0.001, "weight_decay": 0.01,
        "gradient_accumulation_steps": 16, "gradient_checkpointing": True, "max_steps": 10000,
        "save_steps": 100, "save_total_limit": 1, "warmup_steps": 1000, "report_to": "wandb",
        "output_dir": str(tmp_path / "out"), "run_name": "lmms_engine_dllm_test_fineweb_edu",
        "eval_strategy": "no", "logging_steps": 10, "seed": 42, "dataloader_num_workers": 0,
        "bf16": True, "fp16": False, "accelerator_config": {"split_batches": True},
        "lr_scheduler_type": "cosine", "use_liger_kernel": False, "use_rmpad": True,
        "include_num_input_tokens_seen": True, "dataloader_drop_last": True,
        "sp_ulysses_degree": 1, "deepspeed": "/home/user/ds_config/default_config.json",
    }  # fmt: skip
    path = tmp_path / "dllm_train_example.yaml"
    path.write_text(yaml.safe_dump([{"type": "trainer", "config": config}], sort_keys=False))
    conv = _convert_clean(path)
    assert conv.config["model_config"]["objective"] == "masked_diffusion"
    assert conv.config["model_config"]["load_from_config"]["model_type"] == "qwen3"
    _train(path, "trainer_args.max_steps=2", "trainer_args.gradient_accumulation_steps=1",
           "trainer_args.warmup_steps=0", "dataset_config.packing_length=256",
           "model_config.objective_args={mask_token_id: 7}", capsys=capsys)  # fmt: skip
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(rows) == 2 and any(k.startswith("md/") for k in rows[-1]), rows[-1]


@pytest.mark.parametrize("patch", [4, 14], ids=["tiny-patch-4", "patch-14"])
def test_qwen2_5_vl_folder_with_the_local_processor(tmp_path, capsys, patch):
    """A config in lmms-engine's layout over a local Qwen2.5-VL folder (the family's tiny
    config saved with save_pretrained) and `build_local_processor`'s 14-px processor: with the
    tiny config's 4-px patches the processor does not fit (it crashed at the first step with
    `shape '[3528, -1]' is invalid for input of size 9216`): one line before the model is built;
    saved with 14-px patches it trains, as written and after convert-config."""
    from lmms_data import generate_synthetic_vl

    model, proc = _tiny_folder(tmp_path, "qwen2_5_vl", "qwen2_5_vl",
                               vision_config={"patch_size": patch, "window_size": 8 * patch})  # fmt: skip
    generate_synthetic_vl(str(tmp_path / "data"), 8, format="parquet", seed=0)
    cfg = {
        "trainer_type": "fsdp2_trainer",
        "dataset_config": {
            "dataset_type": "vision_iterable", "dataset_format": "yaml",
            "datasets": [{"path": str(tmp_path / "data"), "data_folder": "", "data_type": "parquet"}],
            "processor_config": {"processor_name": proc, "processor_type": "qwen2_5_vl",
                                 "max_pixels": 12544},
            "packing": True, "packing_length": 2048,
        },
        "model_config": {"load_from_pretrained_path": model, "attn_implementation": "sdpa"},
        "trainer_args": {"per_device_train_batch_size": 1, "max_steps": 2, "bf16": False,
                         "output_dir": str(tmp_path / "out"), "report_to": "none",
                         "dataloader_num_workers": 0},
    }  # fmt: skip
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    if patch == 4:
        assert main([str(path), *CPU]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert (
            "image_processor.patch_size is 14 but the model's vision_config.patch_size is 4"
            in (lines[0])
        )
        assert not (tmp_path / "out" / "checkpoints").exists()
        return
    _train(path, capsys=capsys)
    assert main(["convert-config", str(path), "-o", str(tmp_path / "converted.yaml")]) == 0
    capsys.readouterr()
    _train(tmp_path / "converted.yaml", "trainer_args.overwrite_output_dir=true", capsys=capsys)
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 2
