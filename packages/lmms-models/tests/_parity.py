"""Steps the packed-vs-unpacked parity tests share: the reference's gradients, one packed
forward and backward, the padded pack of a family's samples, and the comparison of the two."""

from __future__ import annotations

from typing import Any

import torch

from lmms_models.testing import pack_samples
from lmms_parallel.testing import full_grads


def reference_grads(model: Any, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """Backward of the reference loss ``ref``: each parameter's gradient, then cleared."""
    ref.backward()
    grads = full_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def padded_pack(spec: Any, model: Any, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The packed row of ``samples`` with a 3-token tail padding segment."""
    total = sum(s["input_ids"].numel() for s in samples)
    return pack_samples(spec, model, samples, pad_to=total + 3)


def packed_step(
    spec: Any, model: Any, batch: dict[str, Any]
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """``(loss, supervised tokens, gradients)`` of one packed forward and backward from cleared
    gradients."""
    model.zero_grad(set_to_none=True)
    loss, count = spec.packed_forward(model, batch)
    loss.backward()
    return loss.detach(), int(count), full_grads(model)


def assert_loss_matches(
    loss: torch.Tensor, count: int, ref: torch.Tensor, n_ref: int, batch: dict[str, Any]
) -> None:
    """The packed loss sum equals the reference's over the same supervised tokens."""
    assert count == n_ref == batch["num_loss_tokens"]
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)


def assert_backends_match(
    spec: Any, model: Any, batch: dict[str, Any], ref: torch.Tensor, n: int, backends: list[str]
) -> None:
    """Under bf16 autocast, each varlen ``backend``'s packed loss is the reference's within bf16
    tolerance (on the GPU)."""
    for backend in backends:
        spec.set_attention(model, backend=backend)
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            loss, count = spec.packed_forward(model, batch)
        assert int(count) == n
        torch.testing.assert_close(
            loss.float().cpu(), ref.float().cpu(), rtol=2e-2, atol=1e-2, msg=backend
        )


def one_segment_loss(spec: Any, model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The packed loss with the whole row as one segment (samples see each other): what a
    parity check must tell apart from the per-sample loss."""
    n = batch["input_ids"].numel()
    bad = dict(batch, cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
    with torch.no_grad():
        wrong, _ = spec.packed_forward(model, bad)
    return wrong
