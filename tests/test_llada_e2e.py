"""A LLaDA-layout folder (written by hand with the release's config keys and parameter names)
through lmms-train: it trains with masked diffusion as the ``llama`` family (no remote code, mask
token and non-causal attention from its config), exports, is written back in LLaDA's layout and
loads again with the trained weights; FSDP2 on 2 ranks (rank 0 reads the LLaDA names, renamed on
the way to the shards) and Ulysses SP 2 equal the 1-process run."""

from __future__ import annotations

import json

import pytest
import torch
from e2e_helpers import run_cli, write_config
from safetensors.torch import load_file

from lmms_models.objectives import export_llada, load_dllm
from lmms_models.testing_llada import llada_conf, llada_weights, write_llada
from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.cli import main
from lmms_train.config import config_from_dict

KEYS = ("loss", "md/masked_loss", "md/masked_acc", "md/mask_ratio")


@pytest.fixture(scope="module")
def llada_inputs(tmp_path_factory) -> dict:
    from lmms_data import build_local_processor, generate_synthetic_text

    root = tmp_path_factory.mktemp("llada")
    info = build_local_processor(str(root / "proc"), "qwen2")
    generate_synthetic_text(str(root / "data"), 96, seed=0)
    vocab = (info["vocab_size"] + 63) // 64 * 64
    mask = info["special_token_ids"]["<|audio_pad|>"]
    conf = llada_conf(vocab_size=vocab, embedding_size=vocab, mask_token_id=mask,
                      eos_token_id=info["special_token_ids"]["<|im_end|>"], pad_token_id=None)  # fmt: skip
    folder = write_llada(root / "llada", conf, llada_weights(vocab=vocab))
    return {"root": root, "folder": folder, "mask": mask, "vocab": vocab}


def _cfg(inp: dict, out, **trainer) -> dict:
    return {
        "model_config": {"load_from_pretrained_path": str(inp["folder"]),
                         "processor_path": str(inp["root"] / "proc"),
                         "objective": "masked_diffusion"},
        "dataset_config": {"dataset_path": str(inp["root"] / "data"), "packing_length": 256,
                           "num_workers": 0},
        "trainer_args": {"output_dir": str(out), "max_steps": 4, "report_to": [],
                         "learning_rate": 3e-3, "warmup_steps": 0, "save_final": False,
                         "eval_steps": 0, "save_steps": 0, **trainer},
    }  # fmt: skip


def test_llada_folder_trains_exports_and_reloads(llada_inputs, tmp_path, capsys):
    inp = llada_inputs
    train(config_from_dict(_cfg(inp, tmp_path / "run", export_hf=True)))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 4 and all(r["md/mask_ratio"] > 0 for r in rows)
    hf = tmp_path / "run" / "hf"
    conf = json.loads((hf / "config.json").read_text())
    assert conf["model_type"] == "llama" and conf["is_causal"] is False
    assert conf["mask_token_id"] == inp["mask"] and conf["lmms_diffusion_shift"] is False

    out = export_llada(hf, tmp_path / "llada_out")
    back = json.loads((out / "config.json").read_text())
    assert back["model_type"] == "llada" and back["mask_token_id"] == inp["mask"]
    assert back["d_model"] == 64 and back["embedding_size"] == inp["vocab"]
    trained = load_file(str(hf / "model.safetensors"))
    written = {}
    for f in out.glob("*.safetensors"):
        written.update(load_file(str(f)))
    orig = llada_weights(vocab=inp["vocab"])
    assert set(written) == set(orig)  # the release's names
    w = "model.transformer.blocks.1.ff_proj.weight"
    assert not torch.equal(written[w], orig[w])  # trained
    assert (
        written[w].numpy().tobytes()
        == trained["model.layers.1.mlp.gate_proj.weight"].numpy().tobytes()
    )

    a, b = load_dllm(out), load_dllm(hf)  # the LLaDA folder reloads with the trained weights
    assert a.spec.name == "llama" and a.mask_token_id == inp["mask"] and a.shift is False
    ids = torch.arange(20, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(a.model(input_ids=ids).logits, b.model(input_ids=ids).logits)
    argv = ["sample", str(out), "--processor", str(inp["root"] / "proc"), "--prompt", "2 plus 3?",
            "--gen-length", "4", "--steps", "4", "--show-steps"]  # fmt: skip
    assert main(argv) == 0  # the sampler reads the LLaDA folder too
    printed = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("]")[0] for ln in printed[:4]] == [f"[step {i:3d}" for i in range(1, 5)]


@pytest.mark.multiprocess
def test_llada_fsdp_and_sp_match_single_process(llada_inputs, tmp_path):
    # lr 1e-3: Adam's first update turns last-bit gradient differences of near-zero entries
    # into whole-lr steps; a smaller lr keeps step 2 within the tolerance of the other layouts
    ref = _cfg(llada_inputs, tmp_path / "ref", max_steps=2, gradient_accumulation_steps=2,
               learning_rate=1e-3)  # fmt: skip
    ref["dataset_config"]["num_workers"] = 2
    cfg = write_config(ref, tmp_path / "ref.yaml")
    proc = run_cli([str(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [{k: r[k] for k in KEYS} for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
    assert len(expected) == 2
    runs = {
        "fsdp": ["trainer_args.gradient_accumulation_steps=1", "dataset_config.num_workers=0"],
        "sp": ["trainer_args.sp_ulysses_degree=2"],
    }
    for name, extra in runs.items():
        p = run_cli([str(cfg), f"trainer_args.output_dir={tmp_path / name}", *extra], nproc=2)
        assert p.returncode == 0, p.stderr[-3000:]
        got = read_jsonl(tmp_path / name / "metrics.jsonl")
        for r, e in zip(got, expected, strict=True):
            for k in KEYS:
                assert r[k] == pytest.approx(e[k], rel=2e-5, abs=1e-6), (name, k, r, e)
