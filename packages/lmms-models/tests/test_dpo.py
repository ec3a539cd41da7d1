"""``dpo`` on packed preference pairs == the per-pair unpacked reference (loss, metrics and the
LoRA adapters' gradients), the reference being the same model with its adapters off, on every
registered family whose declared capabilities DPO accepts (``DPO.family_problem``: all causal,
VL, audio and omni families; the diffusion transformers sit and wan are refused)."""

from __future__ import annotations

import pytest
import torch

from lmms_models import LoraOptions, apply_lora, get_model_spec, list_models
from lmms_models.objectives import DPOOptions, ObjectiveContext, dpo_pair_losses, get_objective
from lmms_models.testing import SampleSpec, make_sample, pack_samples, reference_loss_sum
from lmms_models.testing_audio import (
    AudioSampleSpec,
    OmniSampleSpec,
    audio_reference_loss_sum,
    make_audio_sample,
    make_omni_sample,
    pack_audio_samples,
)  # fmt: skip

pytest.importorskip("peft")

# flash-linear-attention's layers run Triton only: on CPU its reference is each document alone
# through the packed forward (one segment), as in test_linear_families.py
ONE_SEGMENT_REFERENCE = {"fla_gated_deltanet"}


def _doc(spec, model, i: int, gen) -> dict:
    """Document ``i`` of the pairs: text, with an image (and audio where the family takes them)
    on even ``i``, in the sample layout of the family's own parity tests."""
    keys, media = spec.media_keys, i % 2 == 0
    if "input_features" in keys and "pixel_values" in keys:  # omni: its processor's layout
        s = OmniSampleSpec(text=6 + i, images=[(1, 4, 4)] * media, audios=[150] * media)
        return make_omni_sample(spec, model.config, s, gen=gen)
    if "input_features" in keys:
        s = AudioSampleSpec(text=6 + i, audios=[[37]] * media, prompt=3)
        return make_audio_sample(spec, model.config, s, gen=gen)
    images = [(1, 4, 4)] if media and "pixel_values" in keys else []
    s = SampleSpec(text=6 + i, images=images, prompt=0 if images else 3)
    return make_sample(spec, model.config, s, gen=gen)


def _pairs(spec, model, n_pairs: int, gen):
    """(chosen, rejected) documents: the same prompt (and media), answers that differ."""
    docs = []
    for i in range(n_pairs):
        chosen = _doc(spec, model, i, gen)
        rejected = {k: v.clone() if torch.is_tensor(v) else v for k, v in chosen.items()}
        k = 3 + i % 2  # the last k tokens are the answer; the rejected one differs
        L = chosen["input_ids"].numel()
        for d in (chosen, rejected):
            d["labels"] = d["labels"].clone()
            d["labels"][: L - k] = -100
        high = int(chosen["input_ids"][L - k :].max()) + 1  # plain text ids (below media ids)
        rejected["input_ids"][L - k :] = torch.randint(0, high, (k,), generator=gen)
        rejected["labels"][L - k :] = rejected["input_ids"][L - k :]
        docs += [chosen, rejected]
    return docs


def _logp(spec, model, doc) -> torch.Tensor:
    """Σ log p of the document's answer, the document alone through the upstream model."""
    if spec.name in ONE_SEGMENT_REFERENCE:
        return -spec.packed_forward(model, pack_samples(spec, model, [doc]))[0]
    if "input_features" in spec.media_keys:
        return -audio_reference_loss_sum(spec, model, [doc])[0]
    return -reference_loss_sum(spec, model, [doc])[0]


def _pack(spec, model, docs, pad_to: int) -> dict:
    if "input_features" in spec.media_keys:
        return pack_audio_samples(spec, model, docs, pad_to=pad_to)
    return pack_samples(spec, model, docs, pad_to=pad_to)


DPO_FAMILIES = [
    n for n in list_models() if get_objective("dpo").family_problem(get_model_spec(n)) is None
]


def test_dpo_accepts_every_causal_and_vl_family():
    refused = sorted(set(list_models()) - set(DPO_FAMILIES))
    # sit and wan: diffusion transformers (no LM head); bagel: its rows are packed by the model
    # (ModelPackedRows), not lmms-data's preference pairs
    assert refused == ["bagel", "sit", "wan"]
    for name in refused:
        assert "dpo" in get_objective("dpo").family_problem(get_model_spec(name))
    assert {"qwen2_5_vl", "qwen3_vl", "llava_onevision", "qwen3", "llama"} <= set(DPO_FAMILIES)


@pytest.mark.parametrize("name", DPO_FAMILIES)
def test_dpo_packed_matches_per_pair_reference(name):
    loss_type = "ipo" if DPO_FAMILIES.index(name) % 2 else "sigmoid"  # both forms across families
    torch.manual_seed(0)
    spec = get_model_spec(name)
    attn = "varlen_sdpa" if name in ONE_SEGMENT_REFERENCE else "sdpa"
    model = spec.build(config=spec.tiny_config(), attn_backend=attn)
    handle = apply_lora(spec, model, LoraOptions(rank=4, alpha=8.0), seed=1)
    with torch.no_grad():  # B = 0 would make the policy the reference (zero margins, no grad A)
        g = torch.Generator().manual_seed(2)
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    docs = _pairs(spec, model, 3, torch.Generator().manual_seed(3))
    opts = DPOOptions(beta=0.5, loss_type=loss_type)

    # reference: every document alone through the upstream model (its own positions and media)
    def logps():
        return torch.stack([_logp(spec, model, d) for d in docs])

    with torch.no_grad(), handle.disabled():
        ref = logps()
    policy = logps()
    n_tok = torch.tensor([float((d["labels"][1:] != -100).sum()) for d in docs])
    losses, rewards = dpo_pair_losses(policy, ref, n_tok, opts)
    losses.sum().backward()
    g_ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    total = sum(d["input_ids"].numel() for d in docs)
    batch = _pack(spec, model, docs, pad_to=total + 5)
    batch["sample_segments"] = torch.full((len(docs) // 2,), 2)
    spec.set_attention(model, backend="varlen_sdpa")
    objective = get_objective("dpo", beta=0.5, loss_type=loss_type)
    assert objective.count_tokens(batch) == 3
    out = objective.loss(spec, model, batch, ObjectiveContext(reference=handle.disabled))
    out.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum.detach(), losses.sum().detach(), rtol=1e-5, atol=1e-6)
    assert int(out.count) == 3
    num, den = out.metrics["dpo/margin"]
    margin = (rewards[0::2] - rewards[1::2]).sum()
    torch.testing.assert_close(float(num), float(margin), rtol=1e-4, atol=1e-6)
    assert float(den) == 3
    g_packed = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(g_packed) == set(g_ref) and all(".lora_" in k for k in g_ref)
    for k in g_ref:
        err = float((g_packed[k] - g_ref[k]).abs().max() / g_ref[k].abs().max())
        assert err < 1e-4, (k, err, float(g_ref[k].abs().max()))

    # the same with the reference log-probabilities precomputed (carried by the pairs)
    model.zero_grad(set_to_none=True)
    batch["ref_logps"] = ref.clone()
    pre = get_objective("dpo", beta=0.5, loss_type=loss_type, reference="precomputed")
    assert not pre.needs_reference()
    out2 = pre.loss(spec, model, batch, ObjectiveContext())
    out2.loss_sum.backward()
    torch.testing.assert_close(out2.loss_sum.detach(), out.loss_sum.detach(), rtol=1e-5, atol=1e-6)
    for k in g_ref:
        err = float((model.get_parameter(k).grad - g_ref[k]).abs().max() / g_ref[k].abs().max())
        assert err < 1e-4, (k, err)


def test_dpo_refuses_what_it_cannot_do():
    spec = get_model_spec("qwen3")
    model = spec.build(config=spec.tiny_config())
    docs = _pairs(spec, model, 1, torch.Generator().manual_seed(0))
    batch = pack_samples(spec, model, docs)
    objective = get_objective("dpo")
    with pytest.raises(ValueError, match="dataset_type: preference"):
        objective.count_tokens(batch)
    batch["sample_segments"] = torch.tensor([2])
    with pytest.raises(ValueError, match="reference"):
        objective.loss(spec, model, batch, ObjectiveContext())
    with pytest.raises(ValueError, match="loss_type"):
        get_objective("dpo", loss_type="hinge2")
