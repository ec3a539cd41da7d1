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
    # the folder is complete: tokenizer, processor and chat template load beside the weights
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(tmp_path / "fsdp_None" / "hf"))
    assert type(proc).__name__ == "Qwen2_5_VLProcessor" and proc.chat_template


# Families whose upstream forward on CPU reaches flash-linear-attention's Triton kernels when that
# package is installed (gated DeltaNet layers): loaded and compared here, generation on the GPU.
_TRITON_FORWARD = ("fla_gated_deltanet", "qwen3_5", "qwen3_5_moe")


def _families() -> list[str]:
    import lmms_models

    return [n for n in lmms_models.list_models() if lmms_models.get_model_spec(n).model_class]


def _export_family(family: str, tmp_path):
    """Build the family's tiny model with a local processor, export it in bf16, check the folder
    and load it back: returns (loaded model, tokenizer)."""
    from transformers import AutoProcessor, AutoTokenizer

    from lmms_models import get_model_spec
    from lmms_train._data_setup import prepare_inputs
    from lmms_train._dist import DistEnv
    from lmms_train._export import auto_class_for, export_run
    from lmms_train._model_setup import model_config_dict, resolve_spec

    spec = get_model_spec(family)
    proc_dir = str(tmp_path / "processor")
    cfg = config_from_dict({
        "model_config": {"load_from_config": {"model_type": family, "tiny": True},
                         "processor_path": proc_dir, "build_local_processor": True},
        "dataset_config": {"dataset_path": str(tmp_path)},
    })  # fmt: skip
    ids = prepare_inputs(cfg, DistEnv(), spec)
    model = spec.build(config=model_config_dict(cfg, spec, ids))
    out = export_run(
        model, tmp_path / "hf", weights=None, processor_path=proc_dir, dtype="bfloat16"
    )
    folder = config_from_dict({"model_config": {"load_from_pretrained_path": str(out)},
                               "dataset_config": {"dataset_path": str(tmp_path)}})  # fmt: skip
    again = resolve_spec(folder)  # the export trains again with no model_type given
    assert again.model_class == spec.model_class, (family, again.name)
    auto = auto_class_for(model.config, spec.model_class)
    assert auto is not None, f"no Auto class builds {spec.model_class}"
    loaded = auto.from_pretrained(str(out), dtype="auto")
    assert type(loaded).__name__ == spec.model_class
    written = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert {v.dtype for v in written.values() if v.is_floating_point()} == {torch.bfloat16}
    want = {k: v.bfloat16() for k, v in model.state_dict().items()}
    got = loaded.state_dict()  # (a family may keep some parameters in fp32 when it loads)
    assert all(torch.equal(got[k].bfloat16(), want[k]) for k in want if k in got)
    try:
        proc = AutoProcessor.from_pretrained(str(out))
    except (OSError, ValueError, KeyError, TypeError):
        proc = AutoTokenizer.from_pretrained(str(out))
    tok = getattr(proc, "tokenizer", proc)
    assert tok.chat_template, "the chat template travels with the weights"
    assert len(tok) == len(AutoTokenizer.from_pretrained(proc_dir))
    return loaded, tok


def _generate(model, tok, device: str = "cpu") -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    enc = tok(prompt, return_tensors="pt").to(device)
    gen = model.to(device).generate(**enc, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == enc["input_ids"].shape[1] + 4


@pytest.mark.parametrize("family", _families())
def test_export_is_complete_for_every_family(family, tmp_path):
    """Weights in `export_dtype`, the processor and chat template beside them; the folder loads
    with AutoProcessor (or AutoTokenizer) and the model's Auto class and generates."""
    import importlib.util

    loaded, tok = _export_family(family, tmp_path)
    if family in _TRITON_FORWARD and importlib.util.find_spec("fla") is not None:
        return  # generation runs fla's Triton kernels: test_export_generates_on_gpu
    _generate(loaded, tok)


@pytest.mark.gpu
@pytest.mark.parametrize("family", _TRITON_FORWARD)
def test_export_generates_on_gpu(family, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if family not in _families():
        pytest.skip(f"{family} is not registered here")
    loaded, tok = _export_family(family, tmp_path)
    _generate(loaded, tok, "cuda")
