import pytest
import torch
from optim_reference import JORDAN, assert_ns_close, ns5, ns_exact, rel

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


GRAM_SHAPES = [(40, 300), (300, 40), (7, 33), (33, 7), (1, 8), (3, 64, 200), (3, 200, 64)]


@pytest.mark.parametrize(
    ("shape", "schedule"),
    [(s, "jordan") for s in GRAM_SHAPES] + [(s, "polar_express") for s in GRAM_SHAPES[:2]],
)  # (polar express' published bf16 run is itself 0.08-0.25 off float64 below m ~ 24)
def test_gram_form_matches_published_iteration(shape, schedule):
    """Same polynomial on m×m matrices: within bf16 tolerance of the published iteration and
    no further from float64 than it (wide and tall, odd shapes, stacks)."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    sch = lo.COEFFICIENT_SCHEDULES[schedule]
    out = lo.newton_schulz(G, coefficients=schedule, method="gram")
    assert out.shape == G.shape
    assert_ns_close(out, G, 5, list(sch.coefficients), sch.norm_scale)


def test_gram_form_ill_conditioned_and_auto_rule():
    """Singular values spread over 1e-4..1: the bf16 Gram form with its restart stays at least as
    close to float64 as the published bf16 iteration (without the restart it would not)."""
    from lmms_optim._ns import GRAM_MIN_ASPECT, _use_gram

    g = torch.Generator().manual_seed(0)
    m, n = 64, 256
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    G = ((U * torch.logspace(0, -4, m, dtype=torch.float64)) @ V.T).float()
    exact = ns_exact(G)
    err_gram = rel(lo.newton_schulz(G, method="gram"), exact)
    err_pub = rel(lo.newton_schulz_reference(G), exact)
    assert err_gram <= err_pub, (err_gram, err_pub)
    H = torch.randn(200, 48, generator=g)  # tall; step counts around the restart boundaries
    for steps in (1, 2, 3, 4, 6, 7):  # (both bf16 runs drift apart over many steps: compare
        exact = ns_exact(H, steps)  # each with float64 rather than with each other)
        err = rel(lo.newton_schulz(H, steps, method="gram"), exact)
        assert err <= 1.25 * rel(lo.newton_schulz_reference(H, steps), exact) + 5e-3, steps
    assert _use_gram("auto", "auto", 2048, 11008) and _use_gram("auto", "torch", 11008, 2048)
    assert not _use_gram("auto", "auto", 2048, 2048) and not _use_gram("auto", "triton", 8, 64)
    assert GRAM_MIN_ASPECT >= 2 and _use_gram("gram", "auto", 4, 4)
    assert not _use_gram("standard", "auto", 8, 64)
    with pytest.raises(ValueError, match="method"):
        lo.newton_schulz(G, method="fast")  # type: ignore[arg-type]


def test_standard_tall_stack_without_transpose():
    """The torch backend's right-multiplication form on a tall stack equals the transposed wide
    run (the same polynomial) within bf16 tolerance."""
    from lmms_optim._ns import _ns_torch

    G = torch.randn(3, 56, 24, generator=torch.Generator().manual_seed(1))
    X = (G / G.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    tall = _ns_torch(X, JORDAN * 5)
    wide = _ns_torch(X.mT.contiguous(), JORDAN * 5)
    assert tall.shape == G.shape and rel(tall, wide.mT) < 0.02
    assert_ns_close(lo.newton_schulz(G, method="standard", backend="torch"), G)


def test_gram_form_on_triton_needs_triton_where_it_runs(monkeypatch):
    """Muon's Gram form with backend="triton" on a CPU tensor (no interpreter) says what to use."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opt = lo.Muon([torch.nn.Parameter(torch.randn(4, 16))], ns_method="gram", backend="triton")
    opt.param_groups[0]["params"][0].grad = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="backend='torch' or 'auto'"):
        opt.step()


def test_gram_form_takes_triton_where_it_was_measured_faster(monkeypatch):
    """backend="triton" always; "auto" on CUDA for stacks of enough work unless
    LMMS_OPTIM_GRAM_TRITON=0; never on CPU tensors or with backend="torch"."""
    from lmms_optim import _ns
    from lmms_optim._ns import _GRAM_TRITON_MIN_WORK, _gram_symmetric

    X = torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    monkeypatch.delenv("LMMS_OPTIM_GRAM_TRITON", raising=False)
    assert _gram_symmetric("triton", X) and not _gram_symmetric("torch", X)
    assert not _gram_symmetric("auto", X)  # a CPU tensor: cuBLAS's (torch's) Gram form

    class OnCuda:  # only the shape and device are read before the work threshold
        is_cuda = True

        def __init__(self, *shape: int) -> None:
            self.shape = shape

    monkeypatch.setattr(_ns, "_triton_usable", lambda X: True)
    # the measured boundary: one 2048x11008 stays on cuBLAS, one 4096x14336 and the model's
    # 36-matrix stacks of 2048x11008 take Triton
    assert 2048 * 2048 * 11008 < _GRAM_TRITON_MIN_WORK <= 4096 * 4096 * 14336
    assert not _gram_symmetric("auto", OnCuda(1, 2048, 11008))
    assert _gram_symmetric("auto", OnCuda(1, 14336, 4096))  # tall: m = min, n = max
    assert _gram_symmetric("auto", OnCuda(36, 2048, 11008))
    monkeypatch.setenv("LMMS_OPTIM_GRAM_TRITON", "0")
    assert not _gram_symmetric("auto", OnCuda(36, 2048, 11008))
    assert _gram_symmetric("triton", OnCuda(1, 8, 32))
