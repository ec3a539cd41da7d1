"""Every language-model family the trainer can build states a Liger plan naming its own modules
(``use_liger_kernel`` is on by default, so a plan that names no module fails the run on the GPU
only: the H200 benchmark found qwen2_5 without one)."""

from __future__ import annotations

import pytest

from lmms_kernels import LigerPlan
from lmms_models import GeneratesLatents, get_model_spec, list_models

#: Families without a plan, on purpose: bagel (its RMSNorm/SwiGLU are its own modules) and
#: fla_gated_deltanet (flash-linear-attention's modules already run fused Triton kernels).
NO_PLAN = {"bagel", "fla_gated_deltanet"}
# Diffusion transformers (sit, wan) have no RMSNorm/SwiGLU decoder for Liger.
LM_FAMILIES = [f for f in list_models() if not isinstance(get_model_spec(f), GeneratesLatents)]


@pytest.mark.parametrize("family", LM_FAMILIES)
def test_family_has_liger_plan_naming_its_modules(family):
    spec = get_model_spec(family)
    if family in NO_PLAN:
        assert not spec.liger_plan, family
        return
    assert spec.liger_plan, f"no Liger plan for {family}"
    plan = LigerPlan.of(spec.liger_plan)
    model = spec.build(config=spec.tiny_config(), device="meta")
    classes = {type(m).__name__ for m in model.modules()}
    assert set(plan.rms_norm) & classes, (family, plan.rms_norm)
    if not plan.mlp_optional or set(plan.mlp) & classes:
        assert set(plan.mlp) & classes, (family, plan.mlp)
