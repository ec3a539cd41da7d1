"""Every family's saved folder loads into a model built on meta (the FSDP2 / EP path).

``from_pretrained`` converts a release's layout on load; a meta-device build loaded by
``lmms_parallel.load_full_state_dict`` must too. Found by running ``fsdp: true`` from saved
folders: transformers 5 saves Qwen2.5-VL as ``visual.*`` / ``model.layers.*`` (modules
``model.visual.*`` / ``model.language_model.*``), LLaVA-OneVision as ``language_model.model.*``,
and Qwen3-MoE / Qwen3.5-MoE with per-expert matrices (modules: 3-D ``gate_up_proj`` /
``down_proj``); each was "missing every weight" before."""

from __future__ import annotations

import pytest
import torch

from lmms_models import get_model_spec, list_models
from lmms_parallel import load_full_state_dict, materialize, meta_init
from lmms_parallel._meta import match_saved_names


@pytest.mark.parametrize("family", list_models())
def test_saved_folder_loads_into_a_meta_built_model(tmp_path, family):
    spec = get_model_spec(family)
    torch.manual_seed(0)
    ref = spec.build(config=spec.tiny_config())
    writer = spec.export_writer(ref)
    if writer is None:
        ref.save_pretrained(tmp_path)
    else:
        writer(str(tmp_path), state_dict=ref.state_dict())
    with meta_init():
        model = spec.build(config=spec.tiny_config())
    materialize(model, torch.device("cpu"))
    load_full_state_dict(model, spec.pretrained_weights(str(tmp_path)))
    want = ref.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_ambiguous_or_mismatched_names_are_not_guessed():
    expected = {"a.x.w": torch.zeros(2), "b.x.w": torch.zeros(2), "c.y": torch.zeros(3)}
    saved = {
        "x.w": torch.ones(2),
        "y": torch.ones(4),
    }  # two model keys end in x.w; y's shape differs
    assert set(match_saved_names(saved, expected)) == {"x.w", "y"}  # left for the strict load
    assert set(match_saved_names({"y": torch.ones(3)}, expected)) == {"c.y"}
