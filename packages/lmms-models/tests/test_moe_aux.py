"""MoE router auxiliary loss in the packed forward == upstream ``Qwen3MoeForCausalLM`` /
``Qwen3VLMoeForConditionalGeneration`` (an image sample, deepstack included).

Upstream adds ``router_aux_loss_coef · load_balancing_loss_func(...)`` to its loss when
``config.output_router_logits`` is True; the packed forward returns
``loss_sum + coef · aux · n_loss_tokens``, so ``loss_sum / n`` of a pack must equal upstream's loss
(LM mean + coef · aux) on the same tokens, with the same gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lmms_models import IGNORE_INDEX, get_model_spec
from lmms_models.testing import SampleSpec, make_sample, pack_samples
from lmms_parallel.testing import full_grads

COEF = 0.01
SP_COEF = 1.0


def _model(aux: bool, coef: float = COEF, name: str = "qwen3_moe"):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    moe = dict(output_router_logits=aux, router_aux_loss_coef=coef)
    cfg = spec.tiny_config(**({"text_config": moe} if spec.position_rows > 1 else moe))
    return spec, spec.build(config=cfg, attn_backend="sdpa")


def _sample_spec(spec):
    if spec.position_rows > 1:
        return SampleSpec(text=9, prompt=3, images=[(1, 4, 4)])
    return SampleSpec(text=14, prompt=3)


def _media(spec, model, s):
    out = {k: s[k] for k in ("pixel_values", "image_grid_thw") if k in s}
    if out:
        out["mm_token_type_ids"] = spec.mm_token_type_ids(model.config, s["input_ids"][None])
    return out


def _upstream(model, input_ids, labels, attention_mask=None, **media):
    model.zero_grad(set_to_none=True)
    out = model(
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        use_cache=False,
        **media,
    )
    out.loss.backward()
    return out, full_grads(model)


def _packed(spec, model, batch, experts="eager"):
    model.zero_grad(set_to_none=True)
    spec.set_attention(model, backend="varlen_sdpa")
    spec.set_experts(model, experts)
    try:
        loss_sum, n = spec.packed_forward(model, batch)
        (loss_sum / n).backward()
    finally:
        spec.set_attention(model, backend="sdpa")
        spec.set_experts(model, "eager")
    return loss_sum.detach(), n, full_grads(model)


def _assert_grads(got, ref):
    assert got.keys() == ref.keys()
    assert any(".mlp.gate." in k for k in ref)  # the router weights get gradients
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    ("name", "pad", "experts"),
    [
        ("qwen3_moe", 0, "eager"),
        ("qwen3_moe", 5, "grouped"),
        ("qwen3_vl_moe", 0, "grouped"),
        ("qwen3_vl_moe", 5, "loop"),
    ],
)
def test_one_sample_matches_upstream_loss_with_aux(name, pad, experts):
    """Upstream's eager experts loop as the reference; the packed side on lmms' grouped GEMMs
    or its plain-torch loop."""
    spec, model = _model(aux=True, name=name)
    gen = torch.Generator().manual_seed(1)
    s = make_sample(spec, model.config, _sample_spec(spec), gen=gen)
    ref, g_ref = _upstream(model, s["input_ids"][None], s["labels"][None], **_media(spec, model, s))
    assert ref.aux_loss is not None and float(ref.aux_loss.detach()) > 0.5  # ~top_k when balanced

    n_tok = s["input_ids"].numel()
    batch = pack_samples(spec, model, [s], pad_to=n_tok + pad)  # tail padding is left out of aux
    loss_sum, n, g = _packed(spec, model, batch, experts)
    assert int(n) == batch["num_loss_tokens"] == int((s["labels"][1:] != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss_sum / n, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads(g, g_ref)

    # The aux term is really there: the LM-only loss differs from it by exactly coef · aux.
    lm_only = ref.loss.detach() - COEF * ref.aux_loss.detach()
    assert abs(float(loss_sum / n - lm_only)) > 1e-3
    torch.testing.assert_close(
        loss_sum / n - lm_only, COEF * ref.aux_loss.detach(), rtol=1e-4, atol=1e-7
    )


def test_without_router_logits_loss_is_lm_only():
    spec, model = _model(aux=False)
    gen = torch.Generator().manual_seed(1)
    s = make_sample(spec, model.config, SampleSpec(text=14, prompt=3), gen=gen)
    ref, g_ref = _upstream(model, s["input_ids"][None], s["labels"][None])
    assert ref.aux_loss is None
    loss_sum, n, g = _packed(spec, model, pack_samples(spec, model, [s]))
    torch.testing.assert_close(loss_sum / n, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads(g, g_ref)

    # Same weights with the aux loss switched on: the packed loss grows by coef · aux.
    model.config.output_router_logits = True
    ref_aux, _ = _upstream(model, s["input_ids"][None], s["labels"][None])
    loss_aux, _, _ = _packed(spec, model, pack_samples(spec, model, [s]))
    torch.testing.assert_close(loss_aux / n, ref_aux.loss.detach(), rtol=1e-5, atol=1e-6)
    assert float(loss_aux - loss_sum) > 1e-3 * float(n)


def test_pack_of_several_samples_matches_padded_upstream_batch():
    """A pack's aux is taken over all its real tokens: upstream's padded batch with its mask."""
    spec, model = _model(aux=True)
    gen = torch.Generator().manual_seed(2)
    samples = [
        make_sample(spec, model.config, SampleSpec(text=t, prompt=p), gen=gen)
        for t, p in [(12, 2), (6, 3), (9, 0)]
    ]
    width = max(s["input_ids"].numel() for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):  # right padding
        n = s["input_ids"].numel()
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    ref, g_ref = _upstream(model, ids, labels, mask)

    total = sum(s["input_ids"].numel() for s in samples)
    loss_sum, n, g = _packed(spec, model, pack_samples(spec, model, samples, pad_to=total + 4))
    torch.testing.assert_close(loss_sum / n, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads(g, g_ref)


# ---------------------------------------------------------------- Ulysses SP (2 gloo ranks)


def _sp_worker(rank, world):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from lmms_parallel import SequenceParallel, UlyssesAttention

    spec, model = _model(aux=True, coef=SP_COEF)  # large: slice vs whole-row aux stand out
    gen = torch.Generator().manual_seed(3)
    samples = [
        make_sample(spec, model.config, SampleSpec(text=t, prompt=2), gen=gen) for t in (9, 8)
    ]
    batch = pack_samples(spec, model, samples, pad_to=20)  # 17 real tokens, 3 padding
    spec.set_attention(model, backend="varlen_sdpa")

    # One process, whole row: the LM-only sum and every layer's router logits [T, E].
    gates = [layer.mlp.gate for layer in spec.decoder_blocks(model)]
    logits: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda _m, _a, o: logits.append(o[0])) for g in gates]
    model.config.output_router_logits = False
    with torch.no_grad():
        lm_sum, n_all = spec.packed_forward(model, batch)
        model.config.output_router_logits = True
        whole_row, _ = spec.packed_forward(model, batch)
    for h in hooks:
        h.remove()
    logits = logits[: len(gates)]

    # Expected under SP: each rank's aux on its slice (real tokens only), weighted by its
    # loss-token count, summed over the ranks.
    chunk = batch["input_ids"].numel() // world
    real = torch.arange(batch["input_ids"].numel()) < 17
    expected = lm_sum.clone()
    for r in range(world):
        sl = slice(r * chunk, (r + 1) * chunk)
        aux_r = load_balancing_loss_func(tuple(x[sl] for x in logits), 4, 2, real[sl].float()[None])
        n_r = int((batch["shift_labels"][sl] != IGNORE_INDEX).sum())
        expected = expected + SP_COEF * aux_r * n_r

    group = dist.new_group(list(range(world)))
    handle = SequenceParallel(spec.sp_slice_module(model), group).install()
    spec.set_attention(model, backend="varlen_sdpa", wrapper=UlyssesAttention(group))
    try:
        with torch.no_grad():
            sp_sum, sp_n = spec.packed_forward(model, batch, sp_group=group)
    finally:
        handle.remove()
    values = {"sp_sum": sp_sum, "sp_n": sp_n, "expected": expected, "n_all": n_all,
              "whole_row": whole_row, "lm_sum": lm_sum}  # fmt: skip
    return {k: float(v) for k, v in values.items()}


TWO_RANK_WORKER = "test_moe_aux:_sp_worker"  # run in conftest's session-wide 2-rank spawn


@pytest.mark.multiprocess
def test_sp2_aux_is_token_weighted_mean_of_slice_aux(two_ranks):
    """Under Ulysses SP each rank's aux covers its slice, weighted by its loss-token count."""
    for r in two_ranks(TWO_RANK_WORKER):
        assert int(r["sp_n"]) == int(r["n_all"])
        torch.testing.assert_close(r["sp_sum"], r["expected"], rtol=1e-5, atol=1e-5)
        assert r["sp_sum"] - r["lm_sum"] > 1.0  # the aux term is there
        # ... and it is not the whole row's aux (what one process computes for the pack)
        assert abs(r["sp_sum"] - r["whole_row"]) > 1e-2


def test_expert_load_meter_counts_routed_tokens_once():
    """The meter's per-layer counts are the routers' top-k choices (recomputation under
    activation checkpointing not counted twice); its aux is upstream's aux; its metrics show a
    collapsed router."""
    from torch.utils.checkpoint import checkpoint

    from lmms_models import ExpertLoadMeter

    spec, model = _model(aux=True, name="qwen3_vl_moe")
    gen = torch.Generator().manual_seed(1)
    s = make_sample(spec, model.config, _sample_spec(spec), gen=gen)
    ref, _ = _upstream(model, s["input_ids"][None], s["labels"][None], **_media(spec, model, s))
    meter = ExpertLoadMeter(spec, model)
    chosen = []
    hooks = [
        r.register_forward_hook(lambda _m, _a, o: chosen.append(o[-1].reshape(-1)))
        for r in spec.router_modules(model)
    ]
    block = spec.decoder_blocks(model)[0]
    plain_forward = block.forward
    block.forward = lambda *a, **kw: checkpoint(plain_forward, *a, use_reentrant=False, **kw)
    _packed(spec, model, pack_samples(spec, model, [s]), "grouped")
    for h in hooks:
        h.remove()
    del block.forward
    n_tok = s["input_ids"].numel()
    assert len(chosen) == 4  # 3 layers + layer 0 recomputed in backward
    values = meter.take(torch.device("cpu")).tolist()
    counts = torch.tensor(values[2:]).reshape(3, 4)
    for layer in range(3):
        assert counts[layer].tolist() == torch.bincount(chosen[layer], minlength=4).tolist()
    assert counts.sum(1).tolist() == [2.0 * n_tok] * 3  # top-2, dropless
    metrics = meter.load_metrics(values)
    torch.testing.assert_close(
        metrics["moe/aux_loss"], float(ref.aux_loss.detach()), rtol=1e-5, atol=0
    )
    assert metrics["moe/load_max_over_mean"] >= 1.0
    collapsed = meter.load_metrics([0.0, 0.0] + [8.0, 0.0, 0.0, 0.0] * 3)
    assert collapsed["moe/load_max_over_mean"] == 4.0 and collapsed["moe/dead_experts"] == 0.75
    assert "moe/aux_loss" not in collapsed
    assert meter.take(torch.device("cpu")).sum() == 0  # reset
    meter.remove()
