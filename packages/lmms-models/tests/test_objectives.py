"""The objective registry and the default ``causal_lm`` objective."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmms_models import get_model_spec
from lmms_models.objectives import (
    OBJECTIVE_REGISTRY,
    Objective,
    ObjectiveContext,
    get_objective,
    list_objectives,
    register_objective,
)
from lmms_models.testing import SampleSpec, make_sample, pack_samples


def test_registry_lists_refuses_duplicates_and_suggests():
    assert "causal_lm" in list_objectives()
    with pytest.raises(ValueError, match="already registered"):
        register_objective("causal_lm")(type("Again", (Objective,), {}))
    with pytest.raises(KeyError, match="Did you mean 'causal_lm'"):
        get_objective("causal")
    with pytest.raises(TypeError, match="takes no options"):
        get_objective("causal_lm", eps=0.1)


def test_options_are_checked_by_name():
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Opts:
        alpha: float = 1.0

    name = "_test_objective_options"
    try:
        cls = register_objective(name)(type("WithOpts", (Objective,), {"Options": Opts}))
        assert get_objective(name, alpha=2.0).options.alpha == 2.0
        with pytest.raises(TypeError, match="did you mean 'alpha'"):
            cls(alpah=2.0)
    finally:
        OBJECTIVE_REGISTRY.pop(name, None)


def test_causal_lm_is_the_spec_packed_forward():
    torch.manual_seed(0)
    spec = get_model_spec("qwen3")
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    gen = torch.Generator().manual_seed(1)
    samples = [make_sample(spec, model.config, SampleSpec(text=n), gen=gen) for n in (9, 5)]
    batch = pack_samples(spec, model, samples)
    obj = get_objective("causal_lm")
    out = obj.loss(spec, model, batch, ObjectiveContext())
    ref, n = spec.packed_forward(model, batch)
    assert torch.equal(out.loss_sum, ref) and int(out.count) == int(n)
    assert obj.count_tokens(batch) == batch["num_loss_tokens"] == int(n)
