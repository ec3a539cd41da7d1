"""`model_config.lora` through the trainer (quickstart Qwen2.5-VL, one process on CPU).

From a pretrained base folder: the LoRA run learns, resumes exactly from a checkpoint, and its
two exports agree with the upstream model:
``PeftModel.from_pretrained(base, adapter/)`` and ``from_pretrained(hf/)`` (merged) give the same
logits. Muon takes the adapter matrices; a 4-bit base on CPU is one error line before the build.
DPO on preference pairs (LoRA, the reference = adapters off) starts at log 2 and learns.
FSDP2 and SP with adapters: packages/lmms-models/tests/test_sp_vl.py (its 4-process spawn).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from e2e_helpers import expect_failure, tiny_config, write_config

from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.config import config_from_dict

pytest.importorskip("peft")

LORA = {"rank": 8, "alpha": 16.0, "towers": {"decoder": "lora", "vision": "frozen"}}


def _losses(out):
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def base_folder(tiny_inputs, tmp_path_factory):
    """A tiny pretrained Qwen2.5-VL folder (one full fine-tuning step, exported)."""
    root = tmp_path_factory.mktemp("lora_base")
    cfg = tiny_config(tiny_inputs, root / "run", max_steps=1, export_hf=True, save_final=False)
    train(config_from_dict(cfg))
    return root / "run" / "hf"


def _lora_cfg(tiny_inputs, base, out, **trainer):
    cfg = tiny_config(tiny_inputs, out, **trainer)
    cfg["model_config"] = {
        "load_from_pretrained_path": str(base),
        "processor_path": tiny_inputs["processor"],
        "lora": dict(LORA),
    }
    return cfg


def test_lora_resume_and_exports(tiny_inputs, base_folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    steps = 4
    ref = _lora_cfg(tiny_inputs, base_folder, tmp_path / "ref", max_steps=steps, save_steps=2,
                    export_hf=True, learning_rate=2e-2)  # fmt: skip
    train(config_from_dict(ref))
    expected = _losses(tmp_path / "ref")
    assert len(expected) == steps and expected[-1] < expected[0]

    # exact resume from the step-2 checkpoint
    run = dict(ref)
    run["trainer_args"] = {**ref["trainer_args"], "output_dir": str(tmp_path / "resumed"),
                           "export_hf": False, "save_final": False,
                           "resume_from": str(tmp_path / "ref" / "checkpoints" / "step_000002")}  # fmt: skip
    train(config_from_dict(run))
    got = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")}
    assert [got[s] for s in (3, 4)] == expected[2:]

    # exports: peft's adapter on the upstream base == the merged folder
    adapter = tmp_path / "ref" / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "ref" / "hf").eval()
    base = AutoModelForImageTextToText.from_pretrained(base_folder)
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.randint(0, 200, (1, 17))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, peft(input_ids=ids).logits
        plain = AutoModelForImageTextToText.from_pretrained(base_folder).eval()(input_ids=ids)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain.logits, a, atol=1e-4)  # the adapters changed the model


def test_lora_muon_groups_and_qlora_on_cpu(tiny_inputs, base_folder, tmp_path, capsys):
    from lmms_train._dist import DistEnv
    from lmms_train._model_setup import build_model, resolve_spec
    from lmms_train._optim_setup import build_optimizer

    cfg = config_from_dict(_lora_cfg(tiny_inputs, base_folder, tmp_path / "m", optimizer="muon"))
    spec = resolve_spec(cfg)
    built = build_model(cfg, DistEnv(), spec, None)
    opt = build_optimizer(built.model, spec, cfg.trainer_args)
    names = {id(p): n for n, p in built.model.named_parameters()}
    muon = [names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    other = [names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    assert len(muon) == 2 * len(built.adapter.targets) and not other
    assert all(".lora_A." in n or ".lora_B." in n for n in muon)
    # the memory plan counts what trains: the adapters, not the frozen base
    from lmms_train._memory import model_facts

    facts = model_facts(cfg, spec)
    assert facts.trainable == sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    assert facts.total > 10 * facts.trainable

    # what LoRA does not compose with is refused before the build, each with its reason
    from lmms_train._errors import ConfigError
    from lmms_train._lora_setup import check_lora

    with pytest.raises(ConfigError, match="no TP/EP plan"):
        check_lora(cfg, DistEnv(tp=2, world_size=2))
    cfg.model_config.lora.quantize_base = "nf4"
    check_lora(cfg, DistEnv(device=torch.device("cuda")))  # QLoRA on one GPU: accepted
    check_lora(cfg, DistEnv(device=torch.device("cuda"), fsdp=True, world_size=2))  # FSDP2
    with pytest.raises(ConfigError, match="2 or more ranks"):  # FSDP2's one-rank path: no NF4
        check_lora(cfg, DistEnv(device=torch.device("cuda"), fsdp=True))

    from lmms_train.cli import main

    bad = _lora_cfg(tiny_inputs, base_folder, tmp_path / "q")
    bad["model_config"]["lora"]["quantize_base"] = "nf4"
    path = write_config(bad, tmp_path / "q.yaml")
    err = expect_failure(main, [str(path)], capsys, "nf4", "needs a CUDA GPU")
    assert "model " not in err  # refused before the model is built
    shutil.rmtree(tmp_path / "q", ignore_errors=True)


def _dpo_cfg(tiny_inputs, tmp_path, out, **trainer):
    from lmms_data import generate_synthetic_preference

    data = tmp_path / "pref"
    if not data.exists():
        generate_synthetic_preference(str(data), 48, seed=0)
    cfg = tiny_config(tiny_inputs, out, **trainer)
    cfg["model_config"].update(objective="dpo", objective_args={"beta": 0.1}, lora=dict(LORA))
    cfg["dataset_config"].update(
        dataset_type="preference", dataset_path=str(data), eval_dataset_path=None
    )
    return cfg


def test_dpo_trains_and_logs_rewards(tiny_inputs, tmp_path, capsys):
    import math

    cfg = _dpo_cfg(tiny_inputs, tmp_path, tmp_path / "dpo", max_steps=6, learning_rate=2e-2,
                   save_final=False)  # fmt: skip
    train(config_from_dict(cfg))
    rows = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    assert len(rows) == 6
    # the adapters start at B = 0: the policy is the reference, every reward 0, loss log 2
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert rows[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["dpo/accuracy"] == 0.0
    for key in ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/logp_chosen"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert sum(r["loss"] for r in rows[-2:]) / 2 < math.log(2)  # it learns to prefer chosen
    assert rows[-1]["dpo/margin"] > 0

    from lmms_train.cli import main

    bad = _dpo_cfg(tiny_inputs, tmp_path, tmp_path / "nolora")
    del bad["model_config"]["lora"]
    path = write_config(bad, tmp_path / "nolora.yaml")
    expect_failure(main, [str(path)], capsys, "model_config.lora", "reference")
    bad = _dpo_cfg(tiny_inputs, tmp_path, tmp_path / "nopairs")
    bad["dataset_config"].update(dataset_type="chat", dataset_path=tiny_inputs["data"])
    path = write_config(bad, tmp_path / "nopairs.yaml")
    expect_failure(main, [str(path)], capsys, "dataset_type: preference")


@pytest.mark.gpu
def test_qlora_trains_on_gpu(tmp_path):
    """quantize_base: nf4 through the trainer on one GPU (bf16 masters, NF4 base): it learns and
    writes both exports. QLoRA under FSDP2 (2+ ranks): test_lora.py's gloo test."""
    pytest.importorskip("torchao")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lmms_data import build_local_processor, generate_synthetic_text

    generate_synthetic_text(str(tmp_path / "data"), 256, seed=0)
    build_local_processor(str(tmp_path / "proc"), "qwen3")
    cfg = {
        "model_config": {
            "load_from_config": {"model_type": "qwen3", "tiny": True,
                                 "config": {"hidden_size": 256, "intermediate_size": 512,
                                            "head_dim": 64}},  # whole NF4 blocks
            "processor_path": str(tmp_path / "proc"),
            "lora": {"rank": 8, "alpha": 16, "quantize_base": "nf4"},
        },
        "dataset_config": {"dataset_path": str(tmp_path / "data"), "packing_length": 512,
                           "num_workers": 0},
        "trainer_args": {"output_dir": str(tmp_path / "run"), "max_steps": 8,
                         "learning_rate": 1e-2, "bf16": True, "export_hf": True,
                         "save_steps": 4, "save_final": False, "report_to": []},
    }  # fmt: skip
    train(config_from_dict(cfg))
    losses = _losses(tmp_path / "run")
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "hf" / "config.json").is_file()


@pytest.mark.gpu
def test_lora_base_never_on_the_gpu_in_fp32(tiny_inputs, base_folder, tmp_path):
    """One process with LoRA and bf16: the model is built on the CPU and its frozen base cast to
    bf16 before it moves, so the build's GPU peak stays under the fp32 base's bytes (a 7B QLoRA
    run peaked at 31.4 GiB while building, 14.1 GiB training: RESULTS.md, issue 41)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lmms_train._dist import DistEnv
    from lmms_train._model_setup import build_model, resolve_spec

    cfg = config_from_dict(_lora_cfg(tiny_inputs, base_folder, tmp_path / "m", bf16=True))
    spec = resolve_spec(cfg)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    built = build_model(cfg, DistEnv(device=torch.device("cuda")), spec, None)
    frozen = [p for p in built.model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 and p.is_cuda for p in frozen)
    fp32_base = sum(4 * p.numel() for p in frozen)
    assert torch.cuda.max_memory_allocated() - base < fp32_base
