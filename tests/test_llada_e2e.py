"""A LLaDA-layout folder (written by hand with the release's config keys and parameter names)
through lmms-train: it trains with masked diffusion as the ``llama`` family (no remote code, mask
token and non-causal attention from its config), exports, is written back in LLaDA's layout and
loads again with the trained weights. (FSDP2 on 2 ranks and Ulysses SP 2 from the same folder:
tests/test_cli_layouts.py; the folder is conftest's `llada_inputs`.)"""

from __future__ import annotations

import json

import torch
from e2e_helpers import llada_config
from safetensors.torch import load_file

from lmms_models.layouts import export_llada, load_dllm
from lmms_models.testing_llada import llada_weights
from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.cli import main
from lmms_train.config import config_from_dict


def test_llada_folder_trains_exports_and_reloads(llada_inputs, tmp_path, capsys):
    inp = llada_inputs
    train(config_from_dict(llada_config(inp, tmp_path / "run", export_hf=True)))
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
