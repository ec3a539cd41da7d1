"""Every model family the trainer can build has a Liger patch plan (``use_liger_kernel`` is on by
default, so a missing plan fails the run on the GPU only: the H200 benchmark found qwen2_5)."""

from __future__ import annotations

import pytest

from lmms_kernels import LIGER_FAMILIES
from lmms_models import DiffusionSpec, get_model_spec, list_models

# Diffusion transformers (sit, wan) have no RMSNorm/SwiGLU for Liger, and specs that say
# supports_liger = False (bagel: its own modules) are skipped by the trainer too.
LM_FAMILIES = [
    f
    for f in list_models()
    if not isinstance(get_model_spec(f), DiffusionSpec)
    and getattr(get_model_spec(f), "supports_liger", True)
]


@pytest.mark.parametrize("family", LM_FAMILIES)
def test_family_has_liger_plan_naming_its_modules(family):
    assert family in LIGER_FAMILIES, f"no Liger plan for {family}"
    spec = get_model_spec(family)
    model = spec.build(config=spec.tiny_config(), device="meta")
    classes = {type(m).__name__ for m in model.modules()}
    plan = LIGER_FAMILIES[family]
    assert set(plan.rms_norm) & classes, (family, plan.rms_norm)
    if (
        family not in ("qwen3_moe", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5_moe")
        or set(plan.mlp) & classes
    ):
        assert set(plan.mlp) & classes, (family, plan.mlp)
