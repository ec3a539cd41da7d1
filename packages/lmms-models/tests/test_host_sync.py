"""A packed training step (forward and backward) reads nothing from the device on the host.

On a GPU each such read (``.item()``, ``.tolist()``, a data-dependent size, a device-valued
``if``) makes the host wait for the stream. Here on CPU, :class:`_sync.DeviceReads` follows what
the trainer keeps on the device (parameters, buffers, the batch but the family's ``host_keys``)
and records every op that would read it. The CPU reference attention backend (``varlen_sdpa``,
a per-segment loop over host boundaries) is left out: GPU runs use the FlashAttention kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmms_kernels import _attention as kernels_attention
from lmms_models import ModelSpec, get_model_spec

sys.path.insert(0, str(Path(__file__).parent))

from _sync import DeviceReads, device_tensors
from test_packed_parity import MEDIA_FAMILIES, TEXT_FAMILIES, tiny_pack


def _step_reads(name: str, **spec_attrs) -> list[str]:
    spec, model, batch = tiny_pack(name)
    rec = DeviceReads(ignore=(kernels_attention._sdpa,))
    rec.device(device_tensors(model, batch, spec.host_keys))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in spec_attrs.items():
            mp.setattr(spec, key, value)
        with rec:
            loss, _ = spec.packed_forward(model, batch)
            loss.backward()
    return rec.reads


@pytest.mark.parametrize("name", TEXT_FAMILIES + MEDIA_FAMILIES)
def test_packed_step_reads_nothing_from_the_device(name):
    spec = get_model_spec(name)
    if spec.position_rows > 1 and not spec.host_keys:
        pytest.skip("this transformers does not accept precomputed vision inputs")
    assert _step_reads(name) == []


def test_reads_of_upstream_paths_are_found():
    """The recorder sees upstream's reads: Qwen3-VL's merge (placeholder count check, deepstack's
    boolean indexing) and Qwen3-MoE's mask preparation (the packed-sequence search)."""
    if not get_model_spec("qwen3_vl").host_keys:
        pytest.skip("this transformers does not accept precomputed vision inputs")
    reads = _step_reads("qwen3_vl", host_merge=False)
    assert "aten::_local_scalar_dense" in reads  # the placeholder count check
    assert "aten::index (bool index)" in reads  # deepstack: hidden[visual_pos_masks]
    assert "aten::index_put_ (bool index)" in reads  # ... written back

    spec = get_model_spec("qwen3_moe")
    plain = ModelSpec.media_context  # the base spec's: no prepared mask
    assert _step_reads("qwen3_moe", media_context=lambda model: plain(spec, model)) == [
        "Tensor.__bool__",
        "aten::_local_scalar_dense",
    ]


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5_vl"])
def test_masked_diffusion_step_reads_nothing_from_the_device(name):
    """The masked-diffusion objective (draws, noised row, weighted fused CE, metrics by t
    bucket) adds no host read to the packed step."""
    from lmms_models.objectives import ObjectiveContext, get_objective

    spec = get_model_spec(name)
    if spec.position_rows > 1 and not spec.host_keys:
        pytest.skip("this transformers does not accept precomputed vision inputs")
    spec, model, batch = tiny_pack(name)
    obj = get_objective("masked_diffusion", mask_token_id=7, shift=True)
    obj.prepare_model(spec, model)
    rec = DeviceReads(ignore=(kernels_attention._sdpa,))
    rec.device(device_tensors(model, batch, spec.host_keys))
    with rec:
        out = obj.loss(spec, model, batch, ObjectiveContext(seed=0, step=3))
        out.loss_sum.backward()
    assert rec.reads == []
    assert out.metrics["md/mask_ratio"][0] > 0  # the check ran on a row with masked tokens
