"""The Omni thinkers' two-tower participation is the caller's to ask for
(``ModelSpec.install_participation``), never read from ``torch.distributed`` by model code: once
installed, a pack without media runs both towers on their dummy inputs (vision, then audio), so
every tower parameter gets a (zero) gradient and the loss is unchanged; removed, it does not."""

from __future__ import annotations

import pytest
import torch

from lmms_models import get_model_spec
from lmms_models.testing_audio import OmniSampleSpec, make_omni_sample, pack_audio_samples


def _tower_grads(spec, model):
    towers = (spec.vision_tower(model), spec.audio_tower(model))
    return {n: p.grad for t in towers for n, p in t.named_parameters()}


@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_participation_runs_both_towers_only_when_installed(name):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    spec.set_attention(model, backend="varlen_sdpa")  # the packed forward's attention
    gen = torch.Generator().manual_seed(1)
    samples = [make_omni_sample(spec, model.config, OmniSampleSpec(text=9, prompt=2), gen=gen)]
    batch = pack_audio_samples(spec, model, samples)  # text only: no tower has media
    media = OmniSampleSpec(text=4, images=[(1, 4, 4)], audios=[150])
    with_media = pack_audio_samples(
        spec, model, [make_omni_sample(spec, model.config, media, gen=gen)]
    )

    def step(pack):
        model.zero_grad(set_to_none=True)
        loss, _ = spec.packed_forward(model, pack)
        loss.backward()
        return loss.detach()

    step(with_media)  # the tower parameters a pack with both media trains
    trained = {n for n, g in _tower_grads(spec, model).items() if g is not None}
    assert any(n.startswith("blocks") for n in trained) and any("layers" in n for n in trained)
    plain = step(batch)
    assert all(g is None for g in _tower_grads(spec, model).values())
    handle = spec.install_participation(model, torch.device("cpu"))
    joined = step(batch)
    grads = _tower_grads(spec, model)
    assert {n for n, g in grads.items() if g is not None} == trained
    assert not any(g.any() for g in grads.values() if g is not None)
    assert torch.equal(joined, plain)
    handle.remove()
    assert torch.equal(step(batch), plain)
    assert all(g is None for g in _tower_grads(spec, model).values())
