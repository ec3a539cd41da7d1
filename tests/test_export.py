"""`export_hf: true` writes the fp32 weights of the run, loadable by `from_pretrained`, under the
hub's names: the same file from the one-process default (bf16 module, fp32 masters) as from
one-rank FSDP2."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import tiny_config
from safetensors.torch import load_file

from lmms_train import train
from lmms_train.config import config_from_dict

_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in _TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def test_export_writes_the_fp32_masters_and_loads(tiny_inputs, tmp_path, no_torchrun):
    from lmms_models import get_model_spec

    loaded, written = {}, {}
    for fsdp in (None, True):
        out = tmp_path / f"fsdp_{fsdp}"
        cfg = tiny_config(
            tiny_inputs, out, max_steps=2, save_final=False, bf16=True, fsdp=fsdp, export_hf=True
        )
        train(config_from_dict(cfg))
        (shard,) = sorted((out / "hf").glob("*.safetensors"))
        written[fsdp] = load_file(str(shard))
        assert {v.dtype for v in written[fsdp].values()} == {torch.float32}
        model = get_model_spec("qwen2_5_vl").build(pretrained=str(out / "hf"))
        loaded[fsdp] = model.state_dict()
    assert written[None].keys() == written[True].keys()  # the hub's names from both paths
    assert any(k.startswith("model.layers.") for k in written[True]), sorted(written[True])[:4]
    assert loaded[None].keys() == loaded[True].keys()
    for key, value in loaded[None].items():  # both paths trained the same weights, bit for bit
        assert torch.equal(value, loaded[True][key]), key
    bf16_exact = [v for k, v in loaded[None].items() if k.endswith("weight")]
    assert any(not torch.equal(v, v.bfloat16().float()) for v in bf16_exact)  # not bf16 casts
