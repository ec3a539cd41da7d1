"""docs/adding-a-model.md's worked family runs: the page cannot drift from the code.

The code block after the page's ``worked-example`` marker is executed with its
``@register_model("olmo2")`` renamed to a temporary name, then unregistered. Checked on it:
the packed forward against the upstream unpacked forward (loss, count and gradients, on a row
with a length-1 sample and tail padding, plus the control: one segment for the whole row changes
the loss), ``lm_matmul_params`` against the built module, the Liger plan's classes, the 7B
preset's size, TP refused; and on 2 gloo ranks, Ulysses SP 2 == SP 1 and FSDP2 2 == 1 process.
"""

from __future__ import annotations

import pytest
import torch
from _adding_a_model_doc import register, samples_of, tiny, unregister, worked_example


@pytest.fixture(scope="module")
def spec():
    try:
        yield register(worked_example())
    finally:
        unregister()


def test_packed_forward_equals_the_upstream_unpacked_forward(spec):
    from lmms_models.testing import pack_samples, reference_loss_sum
    from lmms_parallel.testing import full_grads

    model = tiny(spec, "sdpa")
    samples = samples_of(spec, model)
    ref, n_ref = reference_loss_sum(spec, model, samples)  # upstream, one sample at a time
    ref.backward()
    g_ref = full_grads(model)
    model.zero_grad(set_to_none=True)
    total = sum(s["input_ids"].numel() for s in samples)
    batch = pack_samples(spec, model, samples, pad_to=total + 3)
    spec.set_attention(model, backend="varlen_sdpa")
    loss, count = spec.packed_forward(model, batch)
    loss.backward()
    g_packed = full_grads(model)
    assert int(count) == n_ref == batch["num_loss_tokens"]
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert g_packed.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g_packed[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    one = dict(batch, cu_seqlens=torch.tensor([0, total + 3], dtype=torch.int32))
    with torch.no_grad():  # the check can fail: attention across the samples changes the loss
        wrong, _ = spec.packed_forward(model, {**one, "max_seqlen": total + 3})
    assert not torch.allclose(wrong, loss.detach(), rtol=1e-4)


def test_declarations_match_the_module(spec):
    model = tiny(spec, "sdpa")
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert spec.lm_matmul_params(model.config) == params  # lm_head counts: it is a matmul
    classes = {type(m).__name__ for m in model.modules()}
    assert {*spec.liger_plan["rms_norm"], *spec.liger_plan["mlp"]} <= classes
    with torch.device("meta"):  # the preset: OLMo-2 7B has 7.30B parameters
        big = spec.build(config=spec.preset("7b"), device="meta")
    assert 7.25e9 < sum(p.numel() for p in big.parameters()) < 7.35e9
    with pytest.raises(NotImplementedError):
        spec.check_tp(model.config, 2)
    spec.check_sp(model.config, 2)


@pytest.mark.multiprocess
def test_two_ranks_sp_and_fsdp_equal_one_process(spec):
    import _adding_a_model_doc as doc

    from lmms_parallel.testing import spawn_ranks

    for rank, res in enumerate(spawn_ranks(doc.two_ranks, 2, worked_example())):
        for case in ("sp", "fsdp"):
            got = res[case]
            assert "error" not in got, (rank, case, got.get("error"))
            assert got["count"] == got["n"], (rank, case)
            assert got["loss"] == pytest.approx(got["ref"], rel=1e-5), (rank, case)
            assert got["worst"] < 1e-4, (rank, case, got["worst"])
