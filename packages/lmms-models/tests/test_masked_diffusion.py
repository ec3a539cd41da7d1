"""Masked diffusion on the text decoders: draws, bidirectional packed attention, the exact loss.

* draws: ``t`` in ``[eps, 1)``, masks only on supervised tokens, the same for a sample wherever it
  sits (another pack, another position), new at another step or seed;
* packed == unpacked: the packed objective equals Σ over samples of the upstream model run alone
  on the same noised sample (bidirectional upstream attention), loss and gradients, for every
  dense text family, both prediction layouts (``shift``), a length-1 sample and tail padding;
* bidirectionality: a later token changes an earlier position inside its sample and nothing in
  another sample, on every CPU attention backend (and a causal model does not: the check can fail);
* the loss against the formula written from scratch on full logits, and the metrics.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from _parity import padded_pack, reference_grads

from lmms_models import IGNORE_INDEX, get_model_spec
from lmms_models.objectives import (
    ObjectiveContext,
    draw_masks,
    get_objective,
    make_bidirectional,
)
from lmms_models.testing import SampleSpec, make_sample, pack_samples
from lmms_parallel.testing import full_grads

MD_FAMILIES = ["qwen2", "qwen2_5", "qwen3", "llama"]
VL_FAMILIES = ["qwen2_5_vl", "qwen3_vl"]  # their dense text decoders, with media in the packs
MASK_ID = 1001  # inside the tiny vocab (1024), outside the sampled text ids (< 1000)


def _samples(spec, model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shapes = [SampleSpec(text=23, prompt=4), SampleSpec(text=1, prompt=0), SampleSpec(text=11)]
    return [make_sample(spec, model.config, s, gen=gen) for s in shapes]


def _one(sample):
    n = sample["input_ids"].numel()
    return torch.tensor([0, n], dtype=torch.int32)


def test_draws_are_layout_free_and_follow_the_formula():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 1000, (40,), generator=gen), torch.randint(0, 1000, (9,), generator=gen)
    la, lb = a.clone(), b.clone()
    la[:5] = IGNORE_INDEX  # a prompt
    # a alone, and a after b in one row: a's t and mask are the same
    t1, m1 = draw_masks(a, la, torch.tensor([0, 40], dtype=torch.int32), seed=3, step=7, eps=0.1)
    row, lrow = torch.cat([b, a]), torch.cat([lb, la])
    cu = torch.tensor([0, 9, 49], dtype=torch.int32)
    t2, m2 = draw_masks(row, lrow, cu, seed=3, step=7, eps=0.1)
    assert torch.equal(t1, t2[9:]) and torch.equal(m1, m2[9:])
    assert not m1[:5].any()  # prompt tokens are never masked
    assert len(set(t2.tolist())) == 2 and ((t2 >= 0.1) & (t2 < 1)).all()
    t3, _ = draw_masks(a, la, torch.tensor([0, 40], dtype=torch.int32), seed=3, step=8, eps=0.1)
    t4, _ = draw_masks(a, la, torch.tensor([0, 40], dtype=torch.int32), seed=4, step=7, eps=0.1)
    assert t3[0] != t1[0] and t4[0] != t1[0]
    # over many samples: t ~ U(eps, 1) and P(masked | t) = t
    ids = torch.randint(0, 1000, (400 * 64,), generator=gen)
    cu = torch.arange(0, 400 * 64 + 1, 64, dtype=torch.int32)
    t, m = draw_masks(ids, ids, cu, seed=0, step=0, eps=0.05)
    ts, ms = t.view(400, 64)[:, 0], m.view(400, 64).double().mean(1)
    assert abs(float(ts.mean()) - 0.525) < 0.04 and float(ts.min()) >= 0.05
    assert (
        float((ms - ts).abs().mean()) < 0.06
        and float(torch.corrcoef(torch.stack([ts, ms]))[0, 1]) > 0.95
    )


def _reference(spec, model, samples, *, ctx, eps, shift):
    """Σ over samples of the upstream model's own forward on the noised sample (bidirectional
    upstream attention through the config's is_causal), CE on masked tokens / t."""
    total = torch.zeros(())
    for s in samples:
        t, masked = draw_masks(
            s["input_ids"], s["labels"], _one(s), seed=ctx.seed, step=ctx.step, eps=eps
        )
        noised = torch.where(masked, torch.full_like(s["input_ids"], MASK_ID), s["input_ids"])
        logits = model(input_ids=noised[None], use_cache=False).logits[0].float()  # [L, V]
        target = torch.where(masked, s["labels"], IGNORE_INDEX)
        if shift:  # hidden i predicts token i+1
            logits, target, t = logits[:-1], target[1:], t[1:]
        if target.numel() == 0:
            continue
        ce = F.cross_entropy(logits, target, reduction="none", ignore_index=IGNORE_INDEX)
        total = total + (ce / t.float()).sum()
    return total


@pytest.mark.parametrize(
    ("name", "shift"), [(n, False) for n in MD_FAMILIES + VL_FAMILIES] + [("qwen2_5", True)]
)
def test_packed_matches_unpacked_with_the_same_masks(name, shift):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    obj = get_objective("masked_diffusion", mask_token_id=MASK_ID, eps=0.02, shift=shift)
    obj.prepare_model(spec, model)
    assert model.config.is_causal is False and model.config.mask_token_id == MASK_ID
    samples = _samples(spec, model)
    ctx = ObjectiveContext(seed=5, step=2)
    ref = _reference(spec, model, samples, ctx=ctx, eps=0.02, shift=shift)
    g_ref = reference_grads(model, ref)
    batch = padded_pack(spec, model, samples)
    spec.set_attention(model, backend="varlen_sdpa")
    out = obj.loss(spec, model, batch, ctx)
    out.loss_sum.backward()
    g_packed = full_grads(model)
    assert (
        int(out.count)
        == obj.count_tokens(batch)
        == sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in samples)
    )
    assert float(ref.detach()) > 0
    torch.testing.assert_close(out.loss_sum.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert g_packed.keys() == g_ref.keys()
    for k in g_ref:
        scale = float(g_ref[k].abs().max())  # 1/t weights up to 1/eps scale the gradients
        torch.testing.assert_close(g_packed[k], g_ref[k], rtol=1e-4, atol=2e-6 * scale, msg=k)


def _hidden(spec, model, batch):
    with torch.no_grad():
        return spec.packed_hidden(model, batch)[0]


@pytest.mark.parametrize("backend", ["varlen_sdpa", "flex"])
def test_attention_is_bidirectional_inside_samples_only(backend):
    torch.manual_seed(0)
    spec = get_model_spec("qwen3")
    model = spec.build(config=spec.tiny_config(), attn_backend=backend)
    samples = _samples(spec, model)
    batch = pack_samples(spec, model, samples)
    n0 = samples[0]["input_ids"].numel()
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][n0 - 2] = (changed["input_ids"][n0 - 2] + 1) % 1000  # late in sample 0
    causal_delta = (_hidden(spec, model, changed) - _hidden(spec, model, batch)).abs().sum(-1)
    assert causal_delta[: n0 - 2].max() == 0  # causal: earlier positions do not see it
    assert make_bidirectional(spec, model) == len(spec.decoder_blocks(model))
    h0, h1 = _hidden(spec, model, batch), _hidden(spec, model, changed)
    delta = (h1 - h0).abs().sum(-1)  # [T]
    assert delta[: n0 - 2].min() > 0  # every earlier position of sample 0 sees the later token
    assert delta[n0:].max() == 0  # the other samples see nothing of it


def test_loss_and_metrics_match_the_formula_from_scratch():
    torch.manual_seed(0)
    spec = get_model_spec("qwen3")
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    obj = get_objective("masked_diffusion", mask_token_id=MASK_ID, eps=1e-3, t_buckets=2)
    obj.prepare_model(spec, model)
    batch = pack_samples(spec, model, _samples(spec, model, seed=4))
    ctx = ObjectiveContext(seed=1, step=11)
    out = obj.loss(spec, model, batch, ctx)
    # from scratch: every token of every sample, a Python loop over the formula
    ids, labels, cu = batch["input_ids"], batch["labels"], batch["cu_seqlens"].tolist()
    t, masked = draw_masks(ids, labels, batch["cu_seqlens"], seed=1, step=11, eps=1e-3)
    noised = torch.where(masked, MASK_ID, ids)
    with torch.no_grad():
        hidden = spec.packed_hidden(model, dict(batch), input_ids=noised)[0]
        logits = (hidden @ model.lm_head.weight.T).double()  # [T, V], tiny
    total, n_masked, hits = 0.0, 0, 0
    for a, b in itertools.pairwise(cu):
        for i in range(a, b):
            if labels[i] == IGNORE_INDEX or not masked[i]:
                continue
            ce = float(torch.logsumexp(logits[i], 0) - logits[i, labels[i]])
            total += ce / float(t[i])
            n_masked += 1
            hits += int(int(logits[i].argmax()) == int(labels[i]))
    assert n_masked > 5
    assert abs(float(out.loss_sum.detach()) - total) < 1e-4 * max(1.0, total)
    m = {k: (float(a), float(c)) for k, (a, c) in out.metrics.items()}
    assert m["md/masked_acc"] == (hits, n_masked) and m["md/mask_ratio"][0] == n_masked
    assert m["md/mask_ratio"][1] == int((labels != IGNORE_INDEX).sum())
    assert m["md/loss_t0.00-0.50"][1] + m["md/loss_t0.50-1.00"][1] == n_masked


def test_errors_name_the_fix():
    spec = get_model_spec("qwen3")
    model = spec.build(config=spec.tiny_config())
    with pytest.raises(ValueError, match=r"objective_args\.mask_token_id"):
        get_objective("masked_diffusion").prepare_model(spec, model)
    with pytest.raises(ValueError, match="outside the embedding table"):
        get_objective("masked_diffusion", mask_token_id=5000).prepare_model(spec, model)
    with pytest.raises(ValueError, match="eps"):
        get_objective("masked_diffusion", eps=0.0)
    model.config.mask_token_id = 7  # a dLLM checkpoint's config carries it
    obj = get_objective("masked_diffusion")
    obj.prepare_model(spec, model)
    assert obj.mask_token_id == 7 and model.config.is_causal is False


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_gpu_every_backend_matches_the_cpu_reference(name):
    """bf16 on CUDA: every non-causal varlen backend (FA4, flash-attn, torch varlen, Flex) and the
    Triton fused CE with 1/t weights against the fp32 SDPA/torch run of the same draws."""
    import lmms_kernels

    torch.manual_seed(0)
    spec = get_model_spec(name)
    over = {"num_attention_heads": 2, **({"head_dim": 64} if name == "qwen3" else {})}
    model = spec.build(config=spec.tiny_config(**over), attn_backend="varlen_sdpa")
    obj = get_objective("masked_diffusion", mask_token_id=MASK_ID, eps=0.02)
    obj.prepare_model(spec, model)
    batch = pack_samples(spec, model, _samples(spec, model), pad_to=256)
    ctx = ObjectiveContext(seed=3, step=1, loss_backend="torch")
    ref = obj.loss(spec, model, batch, ctx)
    model.cuda()
    backends = [b for b in lmms_kernels.available_backends("cuda") if b != "sdpa"]
    assert backends
    for backend in backends:
        spec.set_attention(model, backend=backend)
        ctx = ObjectiveContext(seed=3, step=1, loss_backend="auto")  # Triton on CUDA
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = obj.loss(spec, model, batch, ctx)
        torch.testing.assert_close(
            out.loss_sum.detach().float().cpu(), ref.loss_sum.detach(), rtol=3e-2, atol=1e-2,
            msg=backend,
        )  # fmt: skip
        for k, (_, den) in ref.metrics.items():
            assert float(out.metrics[k][1]) == float(den), (backend, k)  # same masks
