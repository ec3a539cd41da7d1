"""``dpo`` on packed preference pairs == the per-pair unpacked reference (loss, metrics and the
LoRA adapters' gradients), the reference being the same model with its adapters off."""

from __future__ import annotations

import pytest
import torch

from lmms_models import LoraOptions, apply_lora, get_model_spec
from lmms_models.objectives import DPOOptions, ObjectiveContext, dpo_pair_losses, get_objective
from lmms_models.testing import SampleSpec, make_sample, pack_samples, reference_loss_sum

pytest.importorskip("peft")


def _pairs(spec, model, n_pairs: int, gen):
    """(chosen, rejected) documents: the same prompt (and media), answers that differ."""
    media = "pixel_values" in spec.media_keys
    docs = []
    for i in range(n_pairs):
        images = [(1, 4, 4)] if media and i % 2 == 0 else []
        s = SampleSpec(text=6 + i, images=images, prompt=0 if images else 3)
        chosen = make_sample(spec, model.config, s, gen=gen)
        rejected = {k: v.clone() for k, v in chosen.items()}
        k = 3 + i % 2  # the last k tokens are the answer; the rejected one differs
        L = chosen["input_ids"].numel()
        for d in (chosen, rejected):
            d["labels"][: L - k] = -100
        rejected["input_ids"][L - k :] = torch.randint(0, 500, (k,), generator=gen)
        rejected["labels"][L - k :] = rejected["input_ids"][L - k :]
        docs += [chosen, rejected]
    return docs


@pytest.mark.parametrize(("name", "loss_type"), [("qwen2_5_vl", "sigmoid"), ("qwen3", "ipo")])
def test_dpo_packed_matches_per_pair_reference(name, loss_type):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
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
        return torch.stack([-reference_loss_sum(spec, model, [d])[0] for d in docs])

    with torch.no_grad(), handle.disabled():
        ref = logps()
    policy = logps()
    n_tok = torch.tensor([float((d["labels"][1:] != -100).sum()) for d in docs])
    losses, rewards = dpo_pair_losses(policy, ref, n_tok, opts)
    losses.sum().backward()
    g_ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    total = sum(d["input_ids"].numel() for d in docs)
    batch = pack_samples(spec, model, docs, pad_to=total + 5)
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
