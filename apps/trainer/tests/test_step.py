"""The step keeps losses and the grad norm on the device: run on the meta device, any host
read (`.item()`, `.to("cpu")`, `float()`) raises, so these tests fail if one comes back."""

from __future__ import annotations

import pytest
import torch

from lmms_train._step import PendingScalars, StepClock, grad_norm, run_micro_batches

META = torch.device("meta")


def _model_and_forward():
    model = torch.nn.Linear(4, 3, device=META)

    def forward(model, batch):
        out = model(batch["x"])  # [T, 3]
        return out.sum(), torch.tensor(out.shape[0])

    return model, forward


def test_micro_batch_losses_stay_on_device():
    model, forward = _model_and_forward()
    batches = [{"x": torch.randn(5, 4)} for _ in range(3)]  # moved to meta by the step
    total = run_micro_batches(
        model=model, forward=forward, batches=batches, device=META, scale=0.5
    )  # fmt: skip
    assert total.device == META and total.dtype == torch.float64
    assert model.weight.grad is not None


def test_grad_norm_stays_on_device():
    model, forward = _model_and_forward()
    forward(model, {"x": torch.randn(5, 4, device=META)})[0].backward()
    norm = grad_norm(torch.optim.SGD(model.parameters(), lr=0.1), 1.0, META)
    assert norm.device == META
    idle = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert grad_norm(idle, 1.0, torch.device("cpu")).item() == 0.0  # no grads


def test_pending_scalars_equal_float_of_each():
    loss = torch.tensor(1.2345678901234567, dtype=torch.float64)
    norm = torch.tensor(0.1, dtype=torch.float32)  # not exact in binary: float32 rounding kept
    assert PendingScalars(loss, norm).wait() == [float(loss), float(norm)]


def test_micro_batch_sum_equals_per_batch_host_sum():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    batches = [{"x": torch.randn(7, 4)} for _ in range(3)]

    def forward(model, batch):
        return model(batch["x"]).pow(2).sum(), torch.tensor(7)

    total = run_micro_batches(
        model=model, forward=forward, batches=batches, device=torch.device("cpu"), scale=1.0
    )  # fmt: skip
    with torch.no_grad():
        ref = sum(float(forward(model, b)[0].to(torch.float64)) for b in batches)
    assert float(total) == pytest.approx(ref, rel=0, abs=0)


def test_step_clock_needs_end_and_measures_wall_time_on_cpu():
    clock = StepClock(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before end"):
        clock.seconds()
    clock.end()
    assert 0.0 <= clock.seconds() < 5.0


@pytest.mark.gpu
def test_pending_scalars_do_not_wait_for_the_device():
    """The copy is queued behind the step's work: constructing it returns while the device is
    still busy (a long matmul chain), and wait() then gives the exact values. The chain runs once
    first so that cuBLAS, the CUDA caching allocator and the pinned-memory cache are warm (a
    fresh cudaMalloc/cudaHostAlloc may wait for the device; in a training loop they are cached)."""
    dev = torch.device("cuda")
    x0 = torch.randn(4096, 4096, device=dev)

    def step():
        clock, x = StepClock(dev), x0
        for _ in range(50):
            x = torch.tanh(x @ x) * 0.5
        total = x.sum()
        clock.end()
        return clock, x, total, PendingScalars(total, x.abs().max())

    step()[3].wait()
    torch.cuda.synchronize()
    clock, x, total, pending = step()
    assert not pending.event.query()  # host is ahead: nothing waited for the device
    loss, peak = pending.wait()
    assert loss == float(total) and peak == float(x.abs().max())
    assert clock.seconds() > 0
