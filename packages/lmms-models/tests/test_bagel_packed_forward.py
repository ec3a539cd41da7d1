"""BAGEL through the generic contract: ``packed_forward`` (the ``causal_lm`` objective) is the
text cross-entropy of the row with every latent image clean, and the model itself is loss-free."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _bagel_cases as cases


@pytest.fixture(scope="module")
def tiny():
    return cases.tiny_model()


def test_causal_lm_equals_the_ce_term_on_an_understanding_pack(tiny):
    from lmms_models.objectives import ObjectiveContext, get_objective

    spec, model = tiny
    batch = cases.pack(cases.PACKS["understanding"])
    lm = get_objective("causal_lm").loss(spec, model, batch, ObjectiveContext(seed=3))
    mixed = get_objective("ce_flow_matching").loss(spec, model, batch, ObjectiveContext(seed=3))
    ce_sum, ce_n = mixed.metrics["ce"]
    assert int(lm.count) == int(ce_n) == int(batch["num_ce_tokens"]) > 0
    assert torch.equal(lm.loss_sum.detach(), ce_sum)


@pytest.mark.parametrize("kind", ["generation", "editing", "mixed"])
def test_packed_forward_is_the_clean_row_cross_entropy(tiny, kind):
    spec, model = tiny
    batch = cases.pack(cases.PACKS[kind])
    loss_sum, n = spec.packed_forward(model, batch)
    assert int(n) == int(batch["num_ce_tokens"]) > 0
    # reference: the row with every latent at noise level 0, unfused logits over the vocabulary
    row = spec.prepare_row(model, batch)
    tok = torch.cat([spec.latent_tokens(model, x) for x in row["vae_latents"]])
    with torch.no_grad():
        hidden, pred = model(row, tok, torch.zeros(tok.shape[0]))
    assert pred.shape[0] == int(row["num_fm_tokens"])  # the velocity head, no loss
    idx = row["ce_index"]
    logits = model.language_model.lm_head(hidden[idx]).float()
    ref = F.cross_entropy(logits, row["labels"][idx], reduction="sum")
    torch.testing.assert_close(loss_sum.detach(), ref, rtol=1e-5, atol=1e-4)
    loss_sum.backward()  # the understanding experts, the ViT and the head get gradients
    assert model.language_model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
