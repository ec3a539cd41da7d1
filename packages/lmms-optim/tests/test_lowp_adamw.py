"""lmms_optim.LowPrecisionAdamW and its stochastic rounding (CPU)."""

import copy

import pytest
import torch

from lmms_optim import LowPrecisionAdamW, stochastic_round_

pytest.importorskip("triton")
from optim_scripts import run_script


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above |x| in magnitude, with x's sign (toward and away
    from zero)."""
    bits = x.view(torch.int32)
    down = torch.bitwise_and(bits, -(1 << 16)).view(torch.float32)
    up = (torch.bitwise_and(bits, -(1 << 16)) + (1 << 16)).view(torch.float32)
    return down, up


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    gen = torch.Generator().manual_seed(0)
    x = torch.tensor([1.0 + 2**-10, -3.3e-3, 7.77e5, -0.1, 1e-30], dtype=torch.float32)
    n = 20000
    xs = x.repeat(n, 1)  # [n, 5]
    out = torch.empty_like(xs, dtype=torch.bfloat16)
    stochastic_round_(out, xs, gen)
    down, up = _neighbours(xs)
    r = out.float()
    assert torch.all((r == down) | (r == up))  # one of the two bf16 neighbours, sign kept
    mean = r.double().mean(0)
    ulp = (up[0] - down[0]).double().abs()
    # E[round(x)] = x: the sample mean is within 4 standard errors (<= ulp / (2 sqrt n))
    assert torch.all((mean - x.double()).abs() <= 4 * ulp / (2 * n**0.5)), (mean, x)
    nearest = xs.to(torch.bfloat16).float().double().mean(0)
    assert (nearest[0] - x[0]).abs() > 20 * (mean[0] - x[0]).abs()  # nearest is biased here
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    got = stochastic_round_(torch.empty(5, dtype=torch.bfloat16), special, gen).float()
    assert got[:2].tolist() == [float("inf"), -float("inf")] and got[2].isnan()
    assert got[3:].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="fp32 input"):
        stochastic_round_(torch.empty(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64))


def _problem(seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter((torch.randn(37, 13, generator=gen) * 0.1).to(dtype)),
        torch.nn.Parameter(torch.randn(11, generator=gen).to(dtype)),
    ]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(5)]
    return params, grads


def _run(opt, params, grads, steps):
    for g in grads[:steps]:
        for p, x in zip(params, g, strict=True):
            p.grad = x.to(p.dtype)
        opt.step()


def test_fp32_state_equals_torch_adamw_bit_for_bit():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, grads = _problem()
    ref, _ = _problem()
    _run(LowPrecisionAdamW(ours, state_dtype=torch.float32, chunk_numel=100, **kw), ours, grads, 5)
    _run(torch.optim.AdamW(ref, foreach=False, **kw), ref, grads, 5)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_resume_is_exact_and_the_seed_matters(param_dtype):
    kw = dict(lr=1e-2, weight_decay=0.01, chunk_numel=64, seed=3)
    whole, grads = _problem(dtype=param_dtype)
    opt = LowPrecisionAdamW(whole, **kw)
    _run(opt, whole, grads, 3)
    saved = copy.deepcopy(opt.state_dict())  # what a checkpoint holds (not live references)
    saved_params = [p.detach().clone() for p in whole]
    _run(opt, whole, grads[3:], 2)
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = LowPrecisionAdamW(resumed, **kw)
    opt2.load_state_dict(saved)
    _run(opt2, resumed, grads[3:], 2)
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert sa["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    other, _ = _problem(dtype=param_dtype)
    _run(LowPrecisionAdamW(other, **{**kw, "seed": 4}), other, grads, 5)
    assert not all(torch.equal(a, b) for a, b in zip(whole, other, strict=True))


def test_bf16_second_moment_tracks_only_with_stochastic_rounding():
    """A constant gradient of 1 for 600 steps: exp_avg_sq should reach 1 - 0.999^600 = 0.451.
    Rounded to nearest, bf16 stops at 0.25 (from there the 0.1% step is under half an ulp); with
    stochastic rounding it tracks the true value in the mean."""
    want = 1 - 0.999**600
    got = {}
    for rounding in ("stochastic", "nearest"):
        p = torch.nn.Parameter(torch.zeros(1024))
        opt = LowPrecisionAdamW([p], lr=0.0, weight_decay=0.0, rounding=rounding)
        p.grad = torch.ones(1024)
        for _ in range(600):
            opt.step()
        got[rounding] = opt.state[p]["exp_avg_sq"].float().mean().item()
    assert abs(got["stochastic"] - want) < 0.01 * want, got
    assert abs(got["nearest"] - want) > 0.2 * want, got


def test_clip_scale_and_grad_source():
    kw = dict(lr=1e-2, state_dtype=torch.float32)
    a, grads = _problem()
    b, _ = _problem()
    opt_a = LowPrecisionAdamW(a, **kw)
    bf16_grads = {id(p): g.to(torch.bfloat16) for p, g in zip(a, grads[0], strict=True)}
    opt_a.set_grad_source(lambda p: bf16_grads.get(id(p)))
    norm = opt_a.clip_norm_(0.5)
    want = torch.linalg.vector_norm(torch.cat([g.float().reshape(-1) for g in bf16_grads.values()]))
    torch.testing.assert_close(norm, want)
    opt_a.step()
    opt_b = LowPrecisionAdamW(b, **kw)
    for p, g in zip(b, grads[0], strict=True):
        p.grad = g.to(torch.bfloat16).float()
    torch.nn.utils.clip_grad_norm_(b, 0.5)
    opt_b.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_triton_backend_under_interpreter():
    """The one-kernel Triton backend (`lowp_triton_checks.py`, CPU under TRITON_INTERPRET=1):
    fp32 state equals the torch backend, stochastic rounding tracks the bf16 second moment where
    nearest stalls, a resume with bf16 weights is exact, the weights move as fp32 AdamW's."""
    pytest.importorskip("triton")
    from optim_scripts import run_script  # beside this file

    assert run_script("lowp_triton_checks.py").stdout.strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_backend():
    assert (
        run_script("lowp_triton_checks.py", "cuda", interpret=False).stdout.strip().endswith("ok")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_rounding_and_resume():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.full((1 << 20,), 1.0 + 2**-10, device="cuda")
    out = stochastic_round_(torch.empty_like(x, dtype=torch.bfloat16), x, gen).float()
    assert set(out.unique().tolist()) == {1.0, 1.0078125}
    assert abs(out.double().mean().item() - (1.0 + 2**-10)) < 1e-4
    p = torch.nn.Parameter(torch.randn(4096, 1024, device="cuda").bfloat16())
    q = torch.nn.Parameter(p.detach().clone())
    grads = [torch.randn(4096, 1024, device="cuda") for _ in range(4)]
    a, b = LowPrecisionAdamW([p], lr=1e-3, seed=1, backend="torch"), None
    for i, g in enumerate(grads):
        if i == 2:
            saved = copy.deepcopy(a.state_dict())
            q.data.copy_(p.detach())
        p.grad = g.bfloat16()
        a.step()
    b = LowPrecisionAdamW([q], lr=1e-3, seed=1, backend="torch")
    b.load_state_dict(saved)
    for g in grads[2:]:
        q.grad = g.bfloat16()
        b.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize(
    "flags",
    [
        {"P_SR": False, "S_SR": True, "P_BF16": False, "S_BF16": True, "O_BF16": True},
        {"P_SR": True, "S_SR": True, "P_BF16": True, "S_BF16": True, "HAS_OUT": False},
    ],
    ids=["fp32-masters-bf16-mirrors", "bf16-weights"],
)
def test_fused_kernel_compiles_for_hopper(flags):
    """The one-launch kernel (`lmms_optim._lowp_multi`) compiles to an sm_90 cubin on a machine
    without a GPU: the interpreter (the other CPU tests) does not catch what only the compiler
    rejects (pointer types, constexpr branches, int64 loop bounds)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmms_optim import _lowp_multi

    kernel = _lowp_multi._multi_kernel()
    ptrs = {"static_ptr": "*i64", "dynamic_ptr": "*i64", "numel_ptr": "*i64",
            "chunk_index_ptr": "*i32", "chunk_start_ptr": "*i64", "scale_ptr": "*fp32",
            "n_params": "i32"}  # fmt: skip
    scalars = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "bias_correction2_sqrt",
               "eps", "step_size")  # fmt: skip
    const = {"HAS_SCALE": True, "HAS_OUT": True, "G_BF16": True, "O_BF16": True, "CHUNK": 8192,
             "BLOCK": 1024}  # fmt: skip
    const |= flags
    sig = {**ptrs, **dict.fromkeys(scalars, "fp32"), **dict.fromkeys(const, "constexpr")}
    names = kernel.arg_names
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in const.items()})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # no ptxas in this Triton install
        if "ptxas" in str(exc):
            pytest.skip(f"Triton cannot assemble here: {exc}")
        raise
    assert "cubin" in compiled.asm
