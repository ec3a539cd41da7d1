"""GPU: LLaVA-OneVision's packed forward with the real varlen kernels (bf16 autocast) against the
upstream unpacked forward (anyres images, multi-image, video, text), for every available lmms
varlen backend, with the SigLIP views through the same backend."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_backends_match

from lmms_models import get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples, reference_loss_sum

pytestmark = pytest.mark.gpu


def test_llava_onevision_packed_matches_unpacked_on_gpu():
    import lmms_kernels

    backends = [b for b in lmms_kernels.available_backends() if b in ("fa4", "fa", "torch", "flex")]
    spec = get_model_spec("llava_onevision")
    torch.manual_seed(0)
    # head_dim 64 (text) and 32 (views) so that the flash backends take them
    cfg = spec.tiny_config(
        text_config={"num_attention_heads": 1, "num_key_value_heads": 1},
        vision_config={"num_attention_heads": 1},
    )
    model = spec.build(config=cfg, device="cuda", attn_backend="sdpa")
    gen = torch.Generator().manual_seed(0)
    specs = [
        SampleSpec(text=40),
        SampleSpec(text=1, prompt=0),
        SampleSpec(text=9, images=[(1, 4, 4), (1, 2, 6)]),
        SampleSpec(text=5, images=[(1, 6, 4)]),
        SampleSpec(text=5, videos=[(3, 0, 0)]),
    ]
    samples = [make_sample(spec, model.config, s, gen=gen) for s in specs]
    samples = [{k: v.cuda() for k, v in s.items()} for s in samples]
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        ref, n = reference_loss_sum(spec, model, samples)
    batch = pack_samples(spec, model, samples, pad_to=512)
    assert_backends_match(spec, model, batch, ref, n, backends)
    spec.set_attention(model, backend="sdpa")
