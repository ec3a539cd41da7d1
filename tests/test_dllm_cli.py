"""A Dream-layout dLLM folder through lmms-train: load (as qwen2, shifted prediction, no remote
code), train with masked diffusion, export, write back in Dream's layout, and `lmms-train sample`."""

from __future__ import annotations

import json

import torch
from e2e_helpers import expect_failure

from lmms_models import get_model_spec
from lmms_models.layouts import export_dream
from lmms_models.objectives import get_objective
from lmms_train import train
from lmms_train._metrics import read_jsonl
from lmms_train.cli import main
from lmms_train.config import config_from_dict


def test_dream_folder_trains_exports_and_samples(tmp_path, capsys):
    from lmms_data import build_local_processor, generate_synthetic_text

    info = build_local_processor(str(tmp_path / "proc"), "qwen2")
    generate_synthetic_text(str(tmp_path / "data"), 64, seed=0)
    mask = info["special_token_ids"]["<|audio_pad|>"]
    spec = get_model_spec("qwen2")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(vocab_size=info["vocab_size"] + 8))
    get_objective("masked_diffusion", mask_token_id=mask, shift=True).prepare_model(spec, model)
    model.save_pretrained(tmp_path / "lmms")
    dream = export_dream(tmp_path / "lmms", tmp_path / "dream")
    conf = json.loads((dream / "config.json").read_text())
    conf["auto_map"] = {"AutoModel": "modeling_dream.DreamModel"}  # never imported
    (dream / "config.json").write_text(json.dumps(conf))

    cfg = {
        "model_config": {
            "load_from_pretrained_path": str(dream),
            "processor_path": str(tmp_path / "proc"),
            "objective": "masked_diffusion",
        },
        "dataset_config": {"dataset_path": str(tmp_path / "data"), "packing_length": 256,
                           "num_workers": 0},
        "trainer_args": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "report_to": [],
                         "learning_rate": 1e-3, "export_hf": True, "save_final": False},
    }  # fmt: skip
    train(config_from_dict(cfg))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and rows[0]["md/mask_ratio"] > 0
    out = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert out["is_causal"] is False and out["mask_token_id"] == mask
    assert out["lmms_diffusion_shift"] is True  # read from Dream's layout, kept on export
    back = json.loads(
        (export_dream(tmp_path / "run" / "hf", tmp_path / "dream2") / "config.json").read_text()
    )
    assert back["model_type"] == "Dream" and back["mask_token_id"] == mask

    argv = ["sample", str(tmp_path / "run" / "hf"), "--processor", str(tmp_path / "proc"),
            "--prompt", "What is 2 plus 3?", "--gen-length", "8", "--steps", "4", "--show-steps"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("]")[0] for ln in printed[:4]] == [f"[step {i:3d}" for i in range(1, 5)]
    assert printed[0].count("_") == 6 and "_" not in printed[3]  # 2 tokens committed per step
    expect_failure(main, ["sample", str(tmp_path / "run" / "hf")], capsys, "--prompt")
    expect_failure(main, ["sample", str(tmp_path / "nope"), "--prompt", "x"], capsys, "config.json")
