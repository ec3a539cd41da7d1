import pytest
import torch
import torch.nn.functional as F
from _kernels_ref import (
    FLCE_TOL,
    check_flce,
    check_flce_frozen_weight_and_no_grad,
    check_flce_rows,
    check_flce_weighted,
    flce_case,
)

import lmms_kernels as lk


def _case(t, hd, v, dtype, gen, frac_ignored=0.3, bias=False):
    return flce_case(t, hd, v, dtype, gen, frac_ignored=frac_ignored, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_naive(dtype):
    gen = torch.Generator().manual_seed(0)
    # odd shapes; budgets small enough to force 1-token, odd and single chunks
    for t, hd, v, budget, bias in [
        (37, 24, 101, 101 * 8 * 5, False),
        (16, 8, 33, 1, True),
        (9, 32, 257, 1 << 30, True),
    ]:
        h, w, b, y = _case(t, hd, v, dtype, gen, bias=bias)
        loss, n = lk.fused_linear_cross_entropy(
            h, w, y, bias=b, backend="torch", memory_budget_bytes=budget
        )
        check_flce(loss, n, h, w, b, y, grad_scale=0.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_weights_and_stats(dtype):
    gen = torch.Generator().manual_seed(3)
    for bias, budget in [(False, 101 * 8 * 4), (True, None)]:  # several chunks, one chunk
        check_flce_weighted("torch", dtype, gen, v=101, bias=bias, memory_budget_bytes=budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_labelled_rows_equal_the_full_path(dtype):
    gen = torch.Generator().manual_seed(4)
    for bias, budget in [(False, 101 * 8 * 4), (True, None)]:  # several chunks, one chunk
        check_flce_rows("torch", dtype, gen, v=101, bias=bias, memory_budget_bytes=budget)
    with pytest.raises(ValueError, match="rows"):
        h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
        lk.fused_linear_cross_entropy(h, w, y, rows=torch.tensor([[0]]))


def test_all_ignored_frozen_weight_and_no_grad():
    gen = torch.Generator().manual_seed(1)
    h, w, _, y = _case(5, 8, 11, torch.float32, gen, frac_ignored=1.1)
    loss, n = lk.fused_linear_cross_entropy(h, w, y, backend="torch")
    assert float(loss.detach()) == 0.0 and int(n) == 0
    (gh,) = torch.autograd.grad(loss, (h,))
    assert torch.count_nonzero(gh) == 0
    h2, w2, _, y2 = _case(6, 8, 11, torch.float32, gen, frac_ignored=0.0)
    check_flce_frozen_weight_and_no_grad(h2, w2, y2, "torch")


def test_autocast_mixed_dtypes():
    # bf16 activations from autocast against an fp32 master weight
    gen = torch.Generator().manual_seed(2)
    h, w, _, y = _case(12, 16, 29, torch.float32, gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = lk.fused_linear_cross_entropy(h.bfloat16(), w, y)
    ref = F.cross_entropy((h.bfloat16() @ w.bfloat16().T).float(), y, reduction="sum")
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    loss.backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32


def test_errors():
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="unknown"):
        lk.fused_linear_cross_entropy(h, w, y, backend="x")
    with pytest.raises(RuntimeError, match="liger"):
        lk.fused_linear_cross_entropy(h, w, y, backend="liger")
    with pytest.raises(ValueError, match="labels"):
        lk.fused_linear_cross_entropy(h, w, y[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_matches_chunked_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    h, w, _, y = _case(300, 64, 1000, dtype, gen)
    h, w, y = h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), y.cuda()
    out = {}
    for backend in ("liger", "torch"):
        loss, n = lk.fused_linear_cross_entropy(h, w, y, backend=backend)
        out[backend] = (loss, n, *torch.autograd.grad(loss, (h, w)))
    for a, b in zip(out["liger"], out["torch"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), **FLCE_TOL[dtype])
    # rows= through Liger: the labelled rows only, and an empty set (falls back to "torch")
    for rows in (lk.labelled_rows(y.cpu()).cuda(), torch.zeros(0, dtype=torch.long, device="cuda")):
        loss, n = lk.fused_linear_cross_entropy(h, w, y, backend="liger", rows=rows)
        gh, gw = torch.autograd.grad(loss, (h, w))
        if rows.numel():
            for a, b in zip((loss, n, gh, gw), out["torch"], strict=True):
                torch.testing.assert_close(a.float(), b.float(), **FLCE_TOL[dtype])
        else:
            assert float(loss) == 0.0 and not gh.any() and not gw.any()
