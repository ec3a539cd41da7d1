"""A diffusion transformer's ``packed_forward`` (what ``causal_lm`` and the benchmarks call on any
family) is its own objective's loss: flow matching with the family's defaults, seed 0."""

from __future__ import annotations

import pytest
import torch
from _diffusion_cases import sit_pixel_batch

from lmms_models import get_model_spec
from lmms_models.objectives import ObjectiveContext, get_objective

pytest.importorskip("diffusers")


def test_sit_packed_forward_is_its_flow_matching_loss():
    spec = get_model_spec("sit")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config())
    with torch.no_grad():  # SiT zero-initialises its output layer: make every output count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    batch = sit_pixel_batch()
    loss_sum, count = spec.packed_forward(model, batch)
    obj = get_objective(spec.default_objective, **spec.objective_defaults)
    ref = obj.loss(spec, model, batch, ObjectiveContext(seed=0))
    assert int(count) == int(ref.count) == 4
    assert torch.equal(loss_sum.detach(), ref.loss_sum.detach()) and loss_sum > 0
    other = get_objective(spec.default_objective, convention="rectified_flow")
    assert not torch.equal(
        other.loss(spec, model, batch, ObjectiveContext()).loss_sum, ref.loss_sum
    )
    loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
