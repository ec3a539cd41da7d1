"""Backend "triton" of fused linear CE: on CPU under TRITON_INTERPRET=1 at tiny odd shapes (CI),
and on a GPU at Qwen2.5-3B shapes (``-m gpu``), each against a plain-torch reference.

Triton jits its own library at import, so the interpreter must be on before triton is imported:
``test_under_interpreter`` reruns this file in a subprocess with TRITON_INTERPRET=1, where the
tests marked ``interpreted`` run (they are skipped in the parent process).
"""

import contextlib
import os
import re
import subprocess
import sys

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
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import lmms_kernels as lk

pytest.importorskip("triton")
from lmms_kernels import _flce_triton  # needs triton

# V is not a multiple of the interpreter's 128-column block: 3 blocks, the last partial
T, HD, V = 37, 24, 300


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_under_interpreter's child")


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
def test_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu",
        __file__,
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 14, r.stdout  # every interpreted test ran


def _case(dtype, *, bias, ignore_index=-100, seed=0, t=T):
    gen = torch.Generator().manual_seed(seed)
    return flce_case(t, HD, V, dtype, gen, frac_ignored=0.15, ignore_index=ignore_index, bias=bias)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_kernel_matches_reference(dtype, ignore_index):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(9, V, generator=gen) * 3).to(dtype)
    y = torch.randint(0, V, (9,), generator=gen)
    y[[2, 5]] = ignore_index
    ref_loss, ref_grad = _flce_triton.ce_rows_reference(x, y, ignore_index)
    logits = x.clone()
    loss = _flce_triton.ce_rows(logits, y, ignore_index, write_grad=False)
    torch.testing.assert_close(loss, ref_loss, **FLCE_TOL[torch.float32])
    assert torch.equal(logits, x)  # no grad pass requested: the buffer is untouched
    loss = _flce_triton.ce_rows(logits, y, ignore_index, write_grad=True)
    torch.testing.assert_close(loss, ref_loss, **FLCE_TOL[torch.float32])
    torch.testing.assert_close(
        logits, ref_grad, atol=1e-6 if dtype == torch.float32 else 4e-3, rtol=0
    )
    assert loss[2] == 0 and torch.count_nonzero(logits[[2, 5]]) == 0


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_cross_entropy(dtype, bias):
    itemsize = torch.finfo(dtype).bits // 8
    for ignore_index, budget in [(-100, 10 * V * itemsize), (3, 1), (-100, None)]:
        # chunks of 10 (10+10+10+7), of 1 token, and one chunk under the default budget
        h, w, b, y = _case(dtype, bias=bias, ignore_index=ignore_index)
        loss, n = lk.fused_linear_cross_entropy(
            h, w, y, bias=b, ignore_index=ignore_index, backend="triton", memory_budget_bytes=budget
        )
        check_flce(loss, n, h, w, b, y, ignore_index=ignore_index, grad_scale=0.37)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "check, seed",
    [(check_flce_weighted, 3), (check_flce_rows, 5)],
    ids=["token_weights_and_stats", "labelled_rows_equal_the_full_path"],
)
def test_weights_stats_and_rows(check, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.finfo(dtype).bits // 8
    for bias, budget in [(False, 10 * V * itemsize), (True, None)]:  # chunks of 10, one chunk
        check("triton", dtype, gen, v=V, bias=bias, memory_budget_bytes=budget)


_PY_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "equal"}
_ATEN_READS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero"}


class _NoHostReadsPy(TorchFunctionMode):
    """Python-level reads of a tensor's value (not seen inside autograd backward)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _PY_READS:
            raise AssertionError(f"host sync: {func.__name__}")
        return func(*args, **(kwargs or {}))


class _NoHostReadsAten(TorchDispatchMode):
    """ATen ops that read a value on the host (item, bool, int, float all end in
    _local_scalar_dense), in forward and inside autograd backward."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _ATEN_READS:
            raise AssertionError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_host_reads():
    with _NoHostReadsPy(), _NoHostReadsAten():
        yield


class _SyncsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.sum()

    @staticmethod
    def backward(ctx, g):
        return torch.full((3,), g.item())


@interpreted
def test_no_host_sync():
    # the guard itself sees a read in forward, in bool(), and inside an autograd backward
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(AssertionError, match="host sync"), _no_host_reads():
        x.sum().item()
    with pytest.raises(AssertionError, match="host sync"), _no_host_reads():
        bool(x.sum() > 0)
    with pytest.raises(AssertionError, match="host sync"), _no_host_reads():
        x.detach().tolist()
    with pytest.raises(AssertionError, match="host sync"), _no_host_reads():
        _SyncsInBackward.apply(x).backward()
    h, w, b, y = _case(torch.bfloat16, bias=True)
    with _no_host_reads():
        loss, n = lk.fused_linear_cross_entropy(
            h, w, y, bias=b, backend="triton", memory_budget_bytes=9 * V * 2
        )
        grads = torch.autograd.grad(loss * 0.37 / n, (h, w, b))
    assert all(g is not None for g in grads)


@interpreted
def test_no_grad_and_frozen_weight():
    h, w, _, y = _case(torch.float32, bias=False, seed=2)
    check_flce_frozen_weight_and_no_grad(h, w, y, "triton")
    y[:] = -100
    loss, n = lk.fused_linear_cross_entropy(h, w, y, backend="triton")
    (gh,) = torch.autograd.grad(loss, (h,))
    assert float(loss.detach()) == 0.0 and int(n) == 0 and torch.count_nonzero(gh) == 0


@interpreted
def test_autocast_mixed_dtypes():
    # bf16 activations from autocast against an fp32 master weight: bf16 logits, fp32 grads
    h, w, _, y = _case(torch.float32, bias=False, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = lk.fused_linear_cross_entropy(h, w, y, backend="triton")
    ref = F.cross_entropy((h.bfloat16() @ w.bfloat16().T).float(), y, reduction="sum")
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    loss.backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32


def test_refused_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        lk.fused_linear_cross_entropy(h, w, y, backend="triton")


def _qwen_case(t=4096, hd=2048, v=151936):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(t, hd, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(v, hd, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, v, (t,), device="cuda", generator=gen)
    y[torch.rand(t, device="cuda", generator=gen) < 0.15] = -100
    return h, w, y


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_qwen_shapes_match_torch_backend():
    h, w, y = _qwen_case()
    out = {}
    for backend, budget in [("torch", None), ("triton", 1536 * 151936 * 2)]:  # triton: 3 chunks
        loss, n = lk.fused_linear_cross_entropy(
            h, w, y, backend=backend, memory_budget_bytes=budget
        )
        out[backend] = (loss.detach(), n, *torch.autograd.grad(loss * 0.37, (h, w)))
    (l_t, n_t, gh_t, gw_t), (l_x, n_x, gh_x, gw_x) = out["torch"], out["triton"]
    assert int(n_t) == int(n_x)
    torch.testing.assert_close(l_x, l_t, rtol=1e-3, atol=0)
    assert gh_x.dtype == gw_x.dtype == torch.bfloat16
    assert _rel(gh_x, gh_t) < 1e-2 and _rel(gw_x, gw_t) < 1e-2, (_rel(gh_x, gh_t), _rel(gw_x, gw_t))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_no_host_sync():
    h, w, y = _qwen_case(t=2048)
    lk.fused_linear_cross_entropy(h, w, y, backend="triton")  # first launch compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.zeros((), device="cuda").item()  # the mode does catch a sync here
        loss, n = lk.fused_linear_cross_entropy(h, w, y, backend="triton")
        gh, gw = torch.autograd.grad(loss / n, (h, w))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(gh.float()).all() and torch.isfinite(gw.float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_labelled_rows_match_all_rows_without_sync():
    """`rows=` at Qwen shapes on the GPU: a VL-like pack (first half unlabelled) gives the full
    path's loss and gradients (bf16 GEMMs of another height: rel 1e-2 as above), rows handed
    over from the host keep the call sync-free."""
    h, w, y = _qwen_case()
    y[:2048] = -100
    rows_host = lk.labelled_rows(y.cpu())
    out = {}
    for name, rows in (("all", None), ("rows", rows_host.cuda())):
        loss, n = lk.fused_linear_cross_entropy(h, w, y, backend="triton", rows=rows)
        out[name] = (loss.detach(), n, *torch.autograd.grad(loss * 0.37, (h, w)))
    (l0, n0, gh0, gw0), (l1, n1, gh1, gw1) = out["all"], out["rows"]
    assert int(n0) == int(n1)
    torch.testing.assert_close(l1, l0, rtol=1e-3, atol=0)
    assert _rel(gh1, gh0) < 1e-2 and _rel(gw1, gw0) < 1e-2
    assert torch.count_nonzero(gh1[:2048]) == 0
    rows_dev = rows_host.cuda()  # a pageable host-to-device copy waits for the host: done before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, n = lk.fused_linear_cross_entropy(h, w, y, backend="triton", rows=rows_dev)
        torch.autograd.grad(loss / n, (h, w))
    finally:
        torch.cuda.set_sync_debug_mode(0)
