"""Liger patch mechanics on CPU (with reference ops standing in for the Triton kernels) and
numeric parity with the real kernels on GPU."""

import pytest
import torch
import torch.nn.functional as F
from _kernels_ref import LIGER_PLANS, TINY_CONFIGS, text_forward, tiny_model

import lmms_kernels as lk
from lmms_kernels import _liger

FAMILIES = sorted(TINY_CONFIGS)


def _ref_rms_norm(x, w, eps, offset=0.0, casting="llama"):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":  # everything in fp32, (offset + w), cast at the end
        return (normed * (offset + w.float())).to(x.dtype)
    return w * normed.to(x.dtype)


def _ref_ops():
    return _ref_rms_norm, lambda a, b: F.silu(a) * b


@pytest.fixture
def fake_liger(monkeypatch):
    """Run the patched forwards on CPU with plain-torch stand-ins, counting calls."""
    calls = {"rms": 0, "swiglu": 0}

    def rms(x, w, eps, *args):
        calls["rms"] += 1
        return _ref_rms_norm(x, w, eps, *args)

    def swiglu(a, b):
        calls["swiglu"] += 1
        return F.silu(a) * b

    monkeypatch.setattr(_liger, "_liger_ops", lambda: (rms, swiglu))
    monkeypatch.setattr(_liger, "_use_liger", lambda x: True)
    return calls


def test_patch_scope_wiring_and_exact_unpatch(fake_liger):
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES:
        model, other = tiny_model(family), tiny_model(family)
        dicts = {n: dict(m.__dict__) for n, m in model.named_modules()}
        with torch.no_grad():
            before = text_forward(model, ids)
            handle = lk.apply_liger(model, LIGER_PLANS[family])
            assert handle.patched["rms_norm"], family
            if family == "qwen2_5_vl":  # text and vision MLPs
                assert any("visual" in n for n in handle.patched["swiglu"])
                assert any("visual" in n for n in handle.patched["rms_norm"])
            assert all("forward" not in m.__dict__ for m in other.modules()), (
                "patch leaked to another instance"
            )
            fake_liger.update(rms=0, swiglu=0)
            patched = text_forward(model, ids)
            assert fake_liger["rms"] > 0 and fake_liger["swiglu"] > 0, family
            torch.testing.assert_close(patched, before, atol=1e-5, rtol=1e-5)
            with pytest.raises(RuntimeError, match="already Liger-patched"):
                lk.apply_liger(model, LIGER_PLANS[family])
            handle.remove()
            handle.remove()  # idempotent
            assert {n: dict(m.__dict__) for n, m in model.named_modules()} == dicts
            assert torch.equal(text_forward(model, ids), before), family


def test_grads_flow_through_patched_modules(fake_liger):
    model = tiny_model("qwen3")
    ids = torch.randint(0, 101, (1, 7))
    text_forward(model, ids).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    handle = lk.apply_liger(model, LIGER_PLANS["qwen3"])
    text_forward(model, ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-5, rtol=1e-5, msg=n)
    handle.remove()


def test_zero_centred_rms_norm_uses_the_offset(fake_liger):
    """Qwen3.5's RMSNorm computes x * (1 + w) in fp32: its plan hands Liger offset 1 and the
    "gemma" casting mode, so the patched forward equals upstream's (and a llama-mode patch,
    w * x, would not)."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    norm = mod.Qwen3_5RMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_()
    model = torch.nn.ModuleDict({"norm": norm})
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    want = norm(x)
    handle = lk.apply_liger(model, LIGER_PLANS["qwen3_5"], swiglu=False)
    got = norm(x)
    assert fake_liger["rms"] == 1
    assert torch.equal(got, want)
    assert not torch.equal(_ref_rms_norm(x, norm.weight, norm.eps), want)  # the llama form
    handle.remove()


def test_errors_and_cpu_fallback():
    with pytest.raises(TypeError, match="LigerPlan"):
        lk.apply_liger(torch.nn.Linear(2, 2), "qwen2")  # a name: the plan is the family's
    no_casting = {k: v for k, v in LIGER_PLANS["qwen2"].items() if k != "rms_casting"}
    with pytest.raises(TypeError, match="rms_casting"):  # the family states its norms' numerics
        lk.apply_liger(tiny_model("qwen2"), no_casting)
    no_mlp = {k: v for k, v in LIGER_PLANS["qwen2"].items() if k != "mlp"}
    with pytest.raises(TypeError, match="'mlp'"):  # any missing field is named, not a KeyError
        lk.apply_liger(tiny_model("qwen2"), no_mlp)
    with pytest.raises(RuntimeError, match="found no"):  # wrong plan: nothing matches -> raise
        lk.apply_liger(tiny_model("qwen2"), LIGER_PLANS["qwen3"])
    model = tiny_model("qwen2")
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.GELU()
    with pytest.raises(RuntimeError, match="not SiLU"):
        lk.apply_liger(model, LIGER_PLANS["qwen2"])
    assert all(not hasattr(m, "_lmms_liger_patched") for m in model.modules()), (
        "failed patch must roll back"
    )
    # real ops, CPU tensors: the patched modules fall back to the upstream forward
    model = tiny_model("qwen2")
    ids = torch.randint(0, 101, (1, 5))
    with torch.no_grad():
        want = text_forward(model, ids)
        handle = lk.apply_liger(model, LIGER_PLANS["qwen2"])
        assert torch.equal(text_forward(model, ids), want)
    handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_liger_parity_gpu(family):
    """Outputs and grads with real Liger kernels ≈ upstream; unpatch restores bit-identical outputs."""
    model = tiny_model(family).cuda()
    ids = torch.randint(0, 101, (2, 33), device="cuda")

    def run():
        model.zero_grad()
        out = text_forward(model, ids)
        out.float().square().mean().backward()
        return out.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    out0, g0 = run()
    handle = lk.apply_liger(model, LIGER_PLANS[family])
    out1, g1 = run()
    torch.testing.assert_close(out1, out0, atol=1e-4, rtol=1e-4)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-4, rtol=1e-3, msg=n)
    handle.remove()
    out2, _ = run()
    assert torch.equal(out2, out0)
