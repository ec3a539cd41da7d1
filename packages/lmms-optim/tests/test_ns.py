import pytest
import torch
from optim_reference import JORDAN, assert_ns_close, ns5

import lmms_optim as lo

SHAPES = [(16, 16), (24, 40), (40, 24), (7, 33), (65, 9), (1, 8)]


@pytest.mark.parametrize("shape", SHAPES)
def test_default_matches_published_iteration(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert_ns_close(lo.newton_schulz(G, backend="torch"), G)
    assert_ns_close(lo.newton_schulz(G), G)  # auto -> torch on CPU
    # the package's plain reference is the published iteration, op for op
    torch.testing.assert_close(lo.newton_schulz_reference(G), ns5(G), rtol=0, atol=0)


def test_published_coefficients_and_schedules():
    assert lo.COEFFICIENT_SCHEDULES["jordan"].coefficients == tuple(JORDAN)
    pe = lo.COEFFICIENT_SCHEDULES["polar_express"]
    assert pe.norm_scale == 1.01 and len(pe.for_steps(10)) == 10
    assert pe.for_steps(10)[-1] == (1.875, -1.25, 0.375)
    assert pe.coefficients[0][0] == pytest.approx(8.28721201814563 / 1.01)
    G = torch.randn(32, 48, generator=torch.Generator().manual_seed(3))
    out = lo.newton_schulz(G, coefficients="polar_express", backend="torch")
    assert_ns_close(out, G, 5, list(pe.coefficients), 1.01)
    custom = lo.newton_schulz(G, 3, coefficients=[(2.0, -1.5, 0.5)], backend="torch")
    assert_ns_close(custom, G, 3, [(2.0, -1.5, 0.5)])
    with pytest.raises(ValueError, match="known: jordan, polar_express"):
        lo.newton_schulz(G, coefficients="nope")
    with pytest.raises(ValueError, match="backend"):
        lo.newton_schulz(G, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps"):
        lo.newton_schulz(G, 0)


def test_batched_equals_per_matrix_and_orthogonalises():
    G = torch.randn(5, 24, 56, generator=torch.Generator().manual_seed(0))
    out = lo.newton_schulz(G, backend="torch")
    assert_ns_close(out, G)
    # each matrix is scaled by its own norm: scaling one matrix changes nothing
    G2 = G.clone()
    G2[2] *= 1000
    torch.testing.assert_close(lo.newton_schulz(G2, backend="torch")[2], out[2], atol=0.02, rtol=0)
    # singular values land in Muon's band (not exactly 1 with the Jordan coefficients)
    s = torch.linalg.svdvals(out.float())
    assert s.min() > 0.5 and s.max() < 1.35
    # polar express converges much closer to 1
    s_pe = torch.linalg.svdvals(lo.newton_schulz(G, 8, coefficients="polar_express").float())
    assert (s_pe - 1).abs().max() < 0.1


def test_triton_backend_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        lo.newton_schulz(torch.randn(8, 8), backend="triton")
