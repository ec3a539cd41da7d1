"""A folder saved in a release's layout loads into a model built on meta (the FSDP2 path).

transformers 5 saves Qwen-VL families with the released key names (``visual.*``,
``model.layers.*``) while its modules are ``model.visual.*`` / ``model.language_model.*``;
``from_pretrained`` renames on load, and ``lmms_parallel.load_full_state_dict`` must too (found by
running ``fsdp: true`` from a saved Qwen2.5-VL folder: every weight was "missing"; LLaVA-OneVision
saves ``language_model.model.*`` for ``model.language_model.*``)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from lmms_models import get_model_spec
from lmms_parallel import load_full_state_dict, materialize, meta_init


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_release_layout_loads_into_a_meta_built_model(tmp_path, family):
    spec = get_model_spec(family)
    torch.manual_seed(0)
    ref = spec.build(config=spec.tiny_config())
    ref.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert saved != set(ref.state_dict()), "the release layout differs from the module names"
    with meta_init():
        model = spec.build(config=spec.tiny_config())
    materialize(model, torch.device("cpu"))
    load_full_state_dict(model, str(tmp_path))
    want = ref.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_ambiguous_or_mismatched_names_are_not_guessed():
    from lmms_parallel._meta import match_saved_names

    expected = {"a.x.w": torch.zeros(2), "b.x.w": torch.zeros(2), "c.y": torch.zeros(3)}
    saved = {
        "x.w": torch.ones(2),
        "y": torch.ones(4),
    }  # two model keys end in x.w; y's shape differs
    assert set(match_saved_names(saved, expected)) == {"x.w", "y"}  # left for the strict load
    assert set(match_saved_names({"y": torch.ones(3)}, expected)) == {"c.y"}
