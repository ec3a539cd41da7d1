"""flat_adamw_: the torch backend against torch.optim.AdamW, the Triton kernel against the torch
backend (interpreter on CPU, compiled on CUDA) and against torch's fused AdamW, and its errors.

Run as a script (``python test_flat_adamw.py``, with ``TRITON_INTERPRET=1``) it runs the Triton
interpreter check and exits non-zero on failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optim_scripts import run_script

from lmms_optim import flat_adamw_, segment_chunks

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
SENTINEL = 7.0  # padding and untouched ranges hold this: any write shows


def _layout(shapes, align: int = 64) -> tuple[list[tuple[int, int]], int]:
    """(offset, numel) of each shape placed at ``align``-element offsets, and the total length.
    A padding gap follows a parameter whose size is not a multiple of ``align``."""
    segments, offset = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        segments.append((offset, numel))
        offset += -(-numel // align) * align
    return segments, offset + align  # a trailing gap as well


def _buffers(total: int, grad_dtype: torch.dtype, device="cpu", seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(total, generator=g) * 0.02
    grad = torch.randn(total, generator=g)
    return {
        "master": master.to(device),
        "grad": grad.to(device, grad_dtype),
        "exp_avg": torch.zeros(total, device=device),
        "exp_avg_sq": torch.zeros(total, device=device),
        "out": torch.zeros(total, device=device, dtype=torch.bfloat16),
    }


def _fill_outside(bufs: dict, segments) -> torch.Tensor:
    """Sets every element outside ``segments`` to SENTINEL; returns that mask."""
    outside = torch.ones(bufs["master"].numel(), dtype=torch.bool)
    for o, n in segments:
        outside[o : o + n] = False
    outside = outside.to(bufs["master"].device)
    for t in bufs.values():
        t[outside] = SENTINEL
    return outside


def _step(bufs, chunks, step, backend, grad_scale=None, out=True, **hyper):
    flat_adamw_(
        bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], chunks,
        **(HYPER | hyper), step=step, grad_scale=grad_scale,
        out=bufs["out"] if out else None, backend=backend,
    )  # fmt: skip


# Odd shapes: one above 32768 elements (CPU kernels split it across threads), two whose sizes
# are multiples of 64 (no gap: their chunks are back to back), one of a single element.
SHAPES = [(300, 131), (7,), (33, 64), (1,), (8, 64), (129, 3), (1000,)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_torch_backend_equals_torch_adamw(grad_dtype, scale):
    segments, total = _layout(SHAPES)
    skipped = segments[2]  # a parameter of another group: not in the chunks
    active = [s for s in segments if s != skipped]
    bufs = _buffers(total, grad_dtype)
    outside = _fill_outside(bufs, active)
    before = {k: t.clone() for k, t in bufs.items()}
    chunks = segment_chunks(active, block=1024, device="cpu")
    grad_scale = None if scale is None else torch.tensor(scale)

    params = [torch.nn.Parameter(bufs["master"][o : o + n].clone()) for o, n in active]
    ref = torch.optim.AdamW(
        params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], foreach=False, fused=False,
    )  # fmt: skip
    for step in (1, 2, 3):
        for p, (o, n) in zip(params, active):
            g = bufs["grad"][o : o + n].float()
            p.grad = g if grad_scale is None else g * grad_scale
        ref.step()
        _step(bufs, chunks, step, "torch", grad_scale)
        bufs["grad"].copy_(torch.randn(total).to(grad_dtype).masked_fill_(outside, SENTINEL))

    for p, (o, n) in zip(params, active):  # bitwise, not just close
        state = ref.state[p]
        assert torch.equal(bufs["master"][o : o + n], p.detach())
        assert torch.equal(bufs["exp_avg"][o : o + n], state["exp_avg"])
        assert torch.equal(bufs["exp_avg_sq"][o : o + n], state["exp_avg_sq"])
    inside = ~outside
    assert torch.equal(bufs["out"][inside], bufs["master"][inside].to(torch.bfloat16))
    o, n = skipped
    outside[o : o + n] = False  # the skipped parameter held random values, not the sentinel
    for name in ("master", "exp_avg", "exp_avg_sq", "out"):
        assert torch.equal(bufs[name][outside], before[name][outside]), name
        assert torch.equal(bufs[name][o : o + n], before[name][o : o + n]), name


def test_torch_backend_without_decay_or_out():
    segments, total = _layout([(5, 70), (3,)])
    bufs = _buffers(total, torch.float32)
    start = {k: t.clone() for k, t in bufs.items()}
    chunks = segment_chunks(segments, block=100, device="cpu")
    _step(bufs, chunks, 1, "auto", out=False, weight_decay=0.0)  # auto: torch on CPU
    assert torch.equal(bufs["out"], start["out"])
    o, n = segments[0]
    g = start["grad"][o : o + n]
    # first step, no decay: the update is lr * g / (|g| + eps), i.e. lr * sign(g)
    expect = start["master"][o : o + n] - HYPER["lr"] * g / (g.abs() + HYPER["eps"])
    torch.testing.assert_close(bufs["master"][o : o + n], expect, rtol=1e-6, atol=1e-7)


def test_segment_chunks_cuts_at_block_multiples():
    starts, ends = segment_chunks([(2048, 5), (0, 1000), (1024, 1000), (64, 0)], 512, "cpu")
    assert starts.dtype == ends.dtype == torch.int64
    # sorted by offset; cut at multiples of 512; the empty segment dropped
    assert list(zip(starts.tolist(), ends.tolist())) == [
        (0, 512), (512, 1000), (1024, 1536), (1536, 2024), (2048, 2053),
    ]  # fmt: skip
    starts, ends = segment_chunks([(64, 3000)], 1024, "cpu")
    assert starts.tolist() == [64, 1024, 2048] and ends.tolist() == [1024, 2048, 3064]
    assert (ends - starts).max() <= 1024
    empty = segment_chunks([], 1024, "cpu")
    assert empty[0].numel() == empty[1].numel() == 0


def _interpreter_check() -> list[str]:
    """Triton (interpreted on CPU) against the torch backend on the same ragged chunks."""
    done = []
    # > 2 windows of 1024 (the kernel's unmasked path) and ragged, unaligned chunk ends
    segments, total = _layout([(2500,), (3,), (17, 5), (1100,), (64,)])
    active = segments[:3] + segments[4:]
    for grad_dtype in (torch.float32, torch.bfloat16):
        for scale in (None, 0.5):
            for out in (True, False):
                tri = _buffers(total, grad_dtype, seed=1)
                outside = _fill_outside(tri, active)
                ref = {k: t.clone() for k, t in tri.items()}
                chunks = segment_chunks(active, block=2048, device="cpu")
                grad_scale = None if scale is None else torch.tensor(scale)
                for step in (1, 2):
                    _step(tri, chunks, step, "triton", grad_scale, out)
                    _step(ref, chunks, step, "torch", grad_scale, out)
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    # a few fp32 ulps: torch's CPU lerp fuses a multiply-add the interpreter (numpy) does not
                    torch.testing.assert_close(tri[name], ref[name], rtol=1e-6, atol=1e-8)
                    assert torch.equal(tri[name][outside], ref[name][outside]), name
                if out:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest
                    master, got = tri["master"][~outside], tri["out"][~outside]
                    chopped = (master.view(torch.int32) & -65536).view(torch.float32).bfloat16()
                    assert ((got == master.bfloat16()) | (got == chopped)).all()
                assert torch.equal(tri["out"][outside], ref["out"][outside])
                done.append(f"interpret {grad_dtype} scale={scale} out={out}")
    return done


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    r = run_script(Path(__file__).name)
    assert r.stdout.count("interpret torch.") == 8, r.stdout


def test_errors(monkeypatch):
    segments, total = _layout([(10,)])
    chunks = segment_chunks(segments, 64, "cpu")
    b = _buffers(total, torch.float32)
    m, g, ea, es = b["master"], b["grad"], b["exp_avg"], b["exp_avg_sq"]

    def call(*args, **kw):
        flat_adamw_(*(args or (m, g, ea, es, chunks)), **(HYPER | {"step": 1} | kw))

    with pytest.raises(TypeError, match=r"master must be torch\.float32"):
        call(m.bfloat16(), g, ea, es, chunks)
    with pytest.raises(TypeError, match=r"grad must be torch\.float32 or torch\.bfloat16"):
        call(m, g.half(), ea, es, chunks)
    with pytest.raises(ValueError, match="exp_avg has 9 elements, master has"):
        call(m, g, ea[:9], es, chunks)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        call(m, g, ea, es.view(2, -1), chunks)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        call(m, g, torch.zeros(2 * total)[::2], es, chunks)
    with pytest.raises(TypeError, match=r"out must be torch\.bfloat16"):
        call(out=torch.zeros(total))
    with pytest.raises(ValueError, match="grad_scale must be a 0-d"):
        call(grad_scale=torch.ones(1))
    with pytest.raises(ValueError, match="grad_scale must be fp32"):
        call(grad_scale=torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(TypeError, match="1-D int64"):
        call(m, g, ea, es, (chunks[0].int(), chunks[1]))
    with pytest.raises(TypeError, match="starts, ends"):
        call(m, g, ea, es, chunks[0])
    with pytest.raises(ValueError, match="2 chunk starts but 1 chunk ends"):
        call(m, g, ea, es, (torch.tensor([0, 5]), torch.tensor([5])))
    with pytest.raises(ValueError, match="lies outside the buffers"):
        call(m, g, ea, es, (torch.tensor([0]), torch.tensor([total + 1])))
    with pytest.raises(ValueError, match="step is counted after its increment"):
        call(step=0)
    with pytest.raises(ValueError, match="betas must be in"):
        call(beta2=1.0)
    with pytest.raises(ValueError, match="backend must be"):
        call(backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs triton and CUDA tensors"):
        call(backend="triton")
    with pytest.raises(ValueError, match="segments overlap"):
        segment_chunks([(0, 100), (64, 10)], 64, "cpu")
    with pytest.raises(ValueError, match="non-negative"):
        segment_chunks([(-1, 10)], 64, "cpu")
    with pytest.raises(ValueError, match="block must be"):
        segment_chunks([(0, 10)], 0, "cpu")
    assert torch.equal(m, b["master"])  # nothing was written by a refused call


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_on_cuda_matches_torch_backend_and_fused_adamw(grad_dtype):
    """~50M elements in 20 segments: Triton vs the torch backend and torch's fused AdamW."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 5_000_000, (20,), generator=g).tolist()
    segments, total = _layout([(n,) for n in sizes])
    tri = _buffers(total, grad_dtype, device="cuda")
    outside = _fill_outside(tri, segments)
    ref = {k: t.clone() for k, t in tri.items()}
    chunks = segment_chunks(segments, 8192, "cuda")
    grad_scale = torch.tensor(0.37, device="cuda")
    params = [torch.nn.Parameter(tri["master"][o : o + n].clone()) for o, n in segments]
    fused = torch.optim.AdamW(
        params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], fused=True,
    )  # fmt: skip
    for step in (1, 2, 3):
        for p, (o, n) in zip(params, segments):
            p.grad = tri["grad"][o : o + n].float() * grad_scale
        fused.step()
        _step(tri, chunks, step, "triton", grad_scale)
        _step(ref, chunks, step, "torch", grad_scale)
        new_grad = torch.randn(total, device="cuda").to(grad_dtype).masked_fill_(outside, 7.0)
        tri["grad"].copy_(new_grad), ref["grad"].copy_(new_grad)

    # fp32 rounding only: atol 1e-7 is 1e-5 of an lr=1e-2 step (torch's fused AdamW also takes
    # its bias corrections and 1 - beta in fp32: a few 1e-7 relative)
    tol = {"master": 1e-7, "exp_avg": 1e-7, "exp_avg_sq": 1e-9}
    for name, atol in tol.items():
        torch.testing.assert_close(tri[name], ref[name], rtol=1e-5, atol=atol)
        assert torch.equal(tri[name][outside], ref[name][outside]), name
    for p, (o, n) in zip(params, segments):
        state = {"master": p.detach(), **fused.state[p]}
        for name, atol in tol.items():
            torch.testing.assert_close(tri[name][o : o + n], state[name], rtol=1e-5, atol=atol)
    inside = ~outside
    # out is the kernel's own master rounded to nearest-even, exactly; against the torch
    # backend's out it may differ by one bf16 ulp where the masters straddle a rounding boundary
    assert torch.equal(tri["out"][inside], tri["master"][inside].bfloat16())
    assert torch.equal(tri["out"][outside], ref["out"][outside])
    a, b = tri["out"][inside].float(), ref["out"][inside].float()
    torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-7)
    assert (a != b).float().mean() < 1e-3


if __name__ == "__main__":
    print("\n".join(_interpreter_check()))
