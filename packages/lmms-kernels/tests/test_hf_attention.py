import pytest
import torch
from _kernels_ref import tiny_model
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

import lmms_kernels as lk

V = 101  # vocabulary of the tiny models (_kernels_ref.TINY_CONFIGS)


def _tiny_qwen2():
    """The shared tiny Qwen2 (vocab ``V``), in eval mode, on SDPA."""
    model = tiny_model("qwen2").eval()
    assert model.config._attn_implementation == "sdpa" and model.config.vocab_size == V
    return model


def test_packed_row_matches_per_sample_forward():
    name = lk.register_varlen_attention("lmms_test_varlen", backend="sdpa")
    assert name in AttentionInterface._global_mapping
    model = _tiny_qwen2()
    lens = [5, 9, 3]
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, V, (n,), generator=gen) for n in lens]
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
        model.config._attn_implementation = name
        ids = torch.cat(samples)[None]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
        out = model(
            input_ids=ids,
            position_ids=pos,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=9,
            max_length_k=9,
        )
        torch.testing.assert_close(out.logits[0], ref, atol=1e-5, rtol=1e-5)
        # without cu_seq_lens every row is one segment: a plain batch, like sdpa
        batch = torch.stack([samples[1], samples[1] + 1])
        got = model(input_ids=batch).logits
        model.config._attn_implementation = "sdpa"
        want = model(input_ids=batch).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_mask_is_unpadded_and_4d_mask_raises():
    name = lk.register_varlen_attention("lmms_test_varlen_pad", backend="sdpa")
    model = _tiny_qwen2()
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        model.config._attn_implementation = name
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], atol=1e-5, rtol=1e-5)
    fn = AttentionInterface._global_mapping[name]
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="2-D"):
        fn(model.model.layers[0].self_attn, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="sliding"):
        fn(model.model.layers[0].self_attn, q, q, q, None, sliding_window=4)


def test_causality_dtype_and_wrapper():
    calls = []

    def wrapper(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, inner):
        calls.append((q.dtype, causal, cu_q.tolist()))
        return inner(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=softmax_scale)

    name = lk.register_varlen_attention("lmms_test_flash_wrapped", backend="sdpa", wrapper=wrapper)
    fn = AttentionInterface._global_mapping[name]

    class Vision(torch.nn.Module):
        is_causal = False

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 6, 8, generator=gen)  # fp32 q/k (vision rotary), bf16 v
    v = torch.randn(1, 2, 6, 8, generator=gen).bfloat16()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out, w = fn(
        Vision(),
        q,
        q,
        v,
        None,
        scaling=0.5,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=4,
        max_length_k=4,
    )
    assert w is None and out.shape == (1, 6, 2, 8) and out.dtype == torch.bfloat16
    assert calls == [(torch.bfloat16, False, [0, 2, 6])]
    qt, vt = q[0].transpose(0, 1).bfloat16(), v[0].transpose(0, 1)
    ref = lk.varlen_attention(
        qt, qt, vt, cu, cu, 4, 4, causal=False, softmax_scale=0.5, backend="sdpa"
    )
    torch.testing.assert_close(out[0], ref)
    fn(
        Vision(), q, q, v, None, is_causal=True, cu_seq_lens_q=cu, cu_seq_lens_k=cu
    )  # kwarg beats module
    assert calls[-1][1] is True


def test_unavailable_explicit_backend_raises_at_registration():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="not available"):
        lk.register_varlen_attention("lmms_test_fa4", backend="fa4")


def _set_attn(model, name):
    """Set the implementation on the top, text and vision configs (after construction)."""
    for cfg in (
        model.config,
        getattr(model.config, "text_config", None),
        getattr(model.config, "vision_config", None),
    ):
        if cfg is not None:
            cfg._attn_implementation = name
    for m in model.modules():  # sub-models may hold their own config objects
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def test_qwen2_5_vl_vision_tower_flash_name_matches_sdpa():
    calls = []

    def wrapper(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, inner):
        calls.append((causal, cu_q.tolist()))
        return inner(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=softmax_scale)

    name = lk.register_varlen_attention("lmms_test_flash_vision", backend="sdpa", wrapper=wrapper)
    model = tiny_model("qwen2_5_vl").eval()
    visual = model.model.visual
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    pix = torch.randn(48, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = visual(pix, grid_thw=grid)
        _set_attn(model, name)
        got = visual(pix, grid_thw=grid)
    want = getattr(want, "pooler_output", want)
    got = getattr(got, "pooler_output", got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # one call per block (not a Python loop over windows), bidirectional, boundaries of the tower
    assert len(calls) == 2 and all(c is False for c, _ in calls)
    assert calls[1][1] == [0, 16, 48]  # the full-attention block sees one segment per image


@pytest.mark.gpu
def test_packed_qwen2_auto_backend_gpu():
    """The auto backend (fa4/fa/torch/flex on CUDA) in a bf16 packed row ≈ per-sample SDPA."""
    name = lk.register_varlen_attention("lmms_test_varlen_gpu")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).cuda().bfloat16().eval()
    lens = [100, 37, 250, 1]
    samples = [torch.randint(0, 97, (n,), device="cuda") for n in lens]
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s[None]).logits[0] for s in samples]).float()
        model.config._attn_implementation = name
        cu = torch.tensor(
            [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
        )
        pos = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
        out = model(
            input_ids=torch.cat(samples)[None], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=max(lens), max_length_k=max(lens),
        ).logits[0].float()  # fmt: skip
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)
