"""LoRA (peft's layers, lmms_models.apply_lora): packed == unpacked per sample (loss and adapter
gradients), towers, the adapter-off base, device-independent initial adapters, and both exports
(peft's adapter folder loaded by ``PeftModel.from_pretrained``; merged full weights)."""

from __future__ import annotations

import pytest
import torch
from _parity import assert_loss_matches, packed_step, padded_pack, reference_grads

from lmms_models import LoraOptions, apply_lora, get_model_spec
from lmms_models.testing import SampleSpec, make_sample, reference_loss_sum

pytest.importorskip("peft")


def _samples(spec, model):
    ss = [SampleSpec(text=12), SampleSpec(text=1, prompt=0), SampleSpec(text=7, prompt=3)]
    if "pixel_values" in spec.media_keys:
        ss += [
            SampleSpec(text=6, images=[(1, 4, 4), (1, 2, 6)]),
            SampleSpec(text=5, videos=[(2, 4, 4)]),
        ]
    gen = torch.Generator().manual_seed(1)
    return [make_sample(spec, model.config, s, gen=gen) for s in ss]


def _lora_model(name: str, opts: LoraOptions, attn: str = "varlen_sdpa"):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend=attn)
    handle = apply_lora(spec, model, opts, seed=3)
    with torch.no_grad():  # B starts at zero (no gradient reaches A): give it values
        g = torch.Generator().manual_seed(5)
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return spec, model, handle


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3"])
def test_lora_packed_matches_unpacked(name):
    opts = LoraOptions(rank=4, alpha=8.0)
    spec, model, handle = _lora_model(name, opts, attn="sdpa")
    samples = _samples(spec, model)
    ref, n_ref = reference_loss_sum(spec, model, samples)
    g_ref = reference_grads(model, ref)
    batch = padded_pack(spec, model, samples)
    spec.set_attention(model, backend="varlen_sdpa")
    loss, count, g_packed = packed_step(spec, model, batch)
    assert_loss_matches(loss, count, ref, n_ref, batch)
    # only the adapters train; every adapter got a gradient, the same as the per-sample reference
    assert set(g_packed) == set(g_ref)
    assert all(".lora_" in k for k in g_packed)
    assert len(g_packed) == 2 * len(handle.targets)
    for k in g_ref:
        assert g_ref[k].abs().sum() > 0, k
        torch.testing.assert_close(g_packed[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def test_lora_towers_and_targets():
    spec = get_model_spec("qwen2_5_vl")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config())
    vision = {id(p) for p in spec.vision_tower(model).parameters()}
    h = apply_lora(spec, model, LoraOptions(rank=2, target_modules=["q_proj", "v_proj"]))
    assert h.targets and all(t.endswith(("q_proj", "v_proj")) for t in h.targets)
    assert all(t.startswith("model.language_model.") for t in h.targets)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)

    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config())
    h = apply_lora(
        spec,
        model,
        LoraOptions(rank=2, towers={"decoder": "lora", "vision": "full"}, train=["lm_head"]),
    )
    vision = spec.vision_tower(model)
    assert all(p.requires_grad for p in vision.parameters())
    assert spec.lm_head(model).weight.requires_grad
    assert not spec.embeddings(model)[0].weight.requires_grad
    assert not any(t.startswith("model.visual") for t in h.targets)

    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config())
    h = apply_lora(spec, model, LoraOptions(rank=2, towers={"vision": "lora", "decoder": "frozen"}))
    assert h.targets and all(t.startswith("model.visual.") for t in h.targets)
    with pytest.raises(ValueError, match="no audio tower"):
        apply_lora(
            spec, spec.build(config=spec.tiny_config()), LoraOptions(towers={"audio": "lora"})
        )
    with pytest.raises(ValueError, match="matches no linear"):
        apply_lora(
            spec, spec.build(config=spec.tiny_config()), LoraOptions(target_modules=["nope"])
        )


def test_lora_off_is_the_base_and_init_is_device_independent():
    spec = get_model_spec("qwen3")
    torch.manual_seed(0)
    base = spec.build(config=spec.tiny_config())
    ids = torch.randint(0, 500, (1, 9))
    ref = base(input_ids=ids).logits
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    handle = apply_lora(spec, base, LoraOptions(rank=4), seed=7)
    torch.testing.assert_close(base(input_ids=ids).logits, ref, rtol=0, atol=0)  # B = 0
    with torch.no_grad():
        for n, p in base.named_parameters():
            if ".lora_B." in n:
                p.fill_(0.1)
    assert not torch.equal(base(input_ids=ids).logits, ref)
    with handle.disabled():
        torch.testing.assert_close(base(input_ids=ids).logits, ref, rtol=0, atol=0)
    # a meta-device build gets the same adapters through adapted_state (the FSDP2 path)
    from lmms_parallel import meta_init

    with meta_init():
        meta = spec.build(config=spec.tiny_config(), device="meta")
    mh = apply_lora(spec, meta, LoraOptions(rank=4), seed=7)
    state = mh.adapted_state(base_sd, seed=7)
    meta.to_empty(device="cpu")
    meta.load_state_dict(state, strict=True)
    fresh = spec.build(config=spec.tiny_config())
    fresh.load_state_dict(base_sd)
    apply_lora(spec, fresh, LoraOptions(rank=4), seed=7)
    for (k, a), (k2, b) in zip(fresh.state_dict().items(), meta.state_dict().items(), strict=True):
        assert k == k2
        if "rotary" not in k:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_lora_exports_load_upstream(tmp_path):
    from peft import PeftModel

    spec, model, handle = _lora_model("qwen2_5_vl", LoraOptions(rank=4, alpha=16.0), attn="sdpa")
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handle.save_adapter(full, tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    gen = torch.Generator().manual_seed(2)
    sample = make_sample(spec, model.config, SampleSpec(text=6, images=[(1, 4, 4)]), gen=gen)
    kwargs = {
        "input_ids": sample["input_ids"][None],
        "pixel_values": sample["pixel_values"],
        "image_grid_thw": sample["image_grid_thw"],
    }
    model.eval()
    ours = model(**kwargs).logits

    merged = handle.merged_state(full)
    upstream = spec.build(config=spec.tiny_config(), attn_backend="sdpa").eval()
    upstream.load_state_dict(merged, strict=True)
    torch.testing.assert_close(upstream(**kwargs).logits, ours, rtol=1e-5, atol=1e-5)

    with handle.disabled():
        base_sd = handle.merged_state(
            {k: (torch.zeros_like(v) if ".lora_B." in k else v) for k, v in full.items()}
        )
    upstream = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    upstream.load_state_dict(base_sd, strict=True)
    peft_model = PeftModel.from_pretrained(upstream, str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(peft_model(**kwargs).logits, ours, rtol=1e-5, atol=1e-5)


def _qlora_model(device: str, dtype: torch.dtype):
    """Qwen3 at 256 wide (its weights split into whole NF4 scaler blocks), adapters, a B != 0."""
    spec = get_model_spec("qwen3")
    cfg = spec.tiny_config(hidden_size=256, intermediate_size=512, head_dim=64)
    torch.manual_seed(0)
    model = spec.build(config=cfg, device=device, dtype=dtype, attn_backend="sdpa")
    handle = apply_lora(spec, model, LoraOptions(rank=8, alpha=16.0), seed=0)
    return spec, model, handle


def _check_qlora(device: str, dtype: torch.dtype) -> None:
    from torchao.quantization import NF4Tensor

    from lmms_models import quantize_base_nf4

    _, model, handle = _qlora_model(device, dtype)
    ids = torch.randint(0, 500, (1, 48), device=device)
    dense = {t: model.get_submodule(t).base_layer.weight.detach().clone() for t in handle.targets}
    assert quantize_base_nf4(handle) == len(handle.targets)
    deq = {}
    for t in handle.targets:
        w = model.get_submodule(t).base_layer.weight
        assert isinstance(w, NF4Tensor) and not w.requires_grad, t
        deq[t] = w.get_original_weight().to(dtype)
        err = float((deq[t].float() - dense[t].float()).norm() / dense[t].float().norm())
        assert 0 < err < 0.15, (t, err)  # 4-bit NormalFloat's rounding of a Gaussian weight
    out = model(input_ids=ids).logits.float()
    out.sum().backward()  # B = 0: the gradient reaches B (and A once B moves)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == 2 * len(handle.targets) and all(".lora_" in n for n in grads)
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)
    with torch.no_grad():  # the same model with the dequantised weights as plain tensors
        for t in handle.targets:
            model.get_submodule(t).base_layer.weight = torch.nn.Parameter(deq[t], False)
        twin = model(input_ids=ids).logits.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.detach(), twin, rtol=tol, atol=tol)


def test_qlora_nf4_wiring_where_torchao_is_installed():
    """The NF4 base on CPU (torchao is not in the workspace environment: skipped there; the
    trainer refuses 4-bit on CPU, this only checks the wiring)."""
    pytest.importorskip("torchao")
    _check_qlora("cpu", torch.float32)


@pytest.mark.gpu
def test_qlora_nf4_gpu():
    """QLoRA on CUDA: every adapted base weight in NF4, logits within NF4's rounding of the bf16
    base, gradients only on the adapters."""
    pytest.importorskip("torchao")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_qlora("cuda", torch.bfloat16)


TWO_RANK_WORKER = "test_lora:_qlora_fsdp_worker"  # run in conftest's session-wide 2-rank spawn


def _qlora_fsdp_worker(rank: int, world: int) -> dict:
    """QLoRA under FSDP2 (2 ranks, one sample each; NF4 base shards) against one process (the NF4
    base whole, both samples): loss, adapter gradients, the gathered base and the merged export,
    and a checkpoint loaded into a model with another base (the loss is the first model's)."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("torchao") is None:
        return {"skip": "torchao is not installed"}
    from torch.distributed.device_mesh import init_device_mesh

    from lmms_models import quantize_base_nf4
    from lmms_parallel import (
        Checkpointer,
        apply_fsdp,
        gather_full_state_dict,
        load_full_state_dict,
        materialize,
        meta_init,
    )  # fmt: skip
    from lmms_parallel.testing import full_grads

    spec, ref, ref_handle = _qlora_model("cpu", torch.float32)
    with torch.no_grad():  # B != 0: the adapters change the output, A gets gradients
        g = torch.Generator().manual_seed(5)
        for n, p in sorted(ref.named_parameters()):
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    full = {k: v.clone() for k, v in ref.state_dict().items()}

    def sharded(weights):  # built as the trainer does: meta, FSDP2, rank 0's weights, then NF4
        with meta_init():
            model = spec.build(config=ref.config.to_dict(), device="meta", attn_backend="sdpa")
        handle = apply_lora(spec, model, LoraOptions(rank=8, alpha=16.0), seed=0)
        apply_fsdp(model, init_device_mesh("cpu", (world,)), blocks=spec.decoder_blocks(model),
                   param_dtype=None)  # fmt: skip
        materialize(model, "cpu")
        load_full_state_dict(model, weights if rank == 0 else None)
        return model, handle, quantize_base_nf4(handle)

    model, handle, quantized = sharded(full)
    out = {"quantized": quantized}
    w = model.get_submodule(handle.targets[0]).base_layer.weight
    out["local_type"] = type(w.to_local()).__name__
    ids = torch.randint(0, 500, (world, 40), generator=torch.Generator().manual_seed(1))

    def loss_of(m):
        return m(input_ids=ids[rank : rank + 1]).logits.float().square().mean()

    loss = loss_of(model)
    loss.backward()
    grads = full_grads(model)
    out["loss"] = float(loss.detach())
    merged = handle.merged_state(gather_full_state_dict(model))
    # resume into another model (other base weights): the checkpoint restores the NF4 shards
    other, _, _ = sharded({k: v * 1.5 if ".base_layer." in k else v for k, v in full.items()})
    with tempfile.TemporaryDirectory() as tmp:  # rank 0's folder for both ranks
        box = [tmp]
        torch.distributed.broadcast_object_list(box, src=0)
        Checkpointer(box[0]).save(1, model=model)
        out["other_loss"] = float(loss_of(other).detach())
        Checkpointer(box[0]).load(model=other)
        out["loss_after_resume"] = float(loss_of(other).detach())
        torch.distributed.barrier()
    if rank == 0:
        out["ref_quantized"] = quantize_base_nf4(ref_handle)
        out["ref_loss"] = 0.0
        for r in range(world):
            ref_loss = ref(input_ids=ids[r : r + 1]).logits.float().square().mean()
            ref_loss.backward()
            out["ref_loss"] += float(ref_loss.detach())
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        out["grad_names_equal"] = sorted(ref_grads) == sorted(grads)
        out["grad_max_diff"] = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
        ref_merged = ref_handle.merged_state(ref.state_dict())
        out["merged_max_diff"] = max(
            float((merged[k].float() - v.float()).abs().max()) for k, v in ref_merged.items()
        )
        out["merged_keys_equal"] = sorted(merged) == sorted(ref_merged)
    return out


def test_qlora_under_fsdp2_matches_one_process(two_ranks):
    """QLoRA composes with FSDP2: NF4 base shards (2 gloo ranks, one sample each) give the loss and
    adapter gradients of one process on both samples, the same merged export, and resume."""
    r0, r1 = two_ranks(TWO_RANK_WORKER)
    if "skip" in r0:
        pytest.skip(r0["skip"])  # torchao is not in the workspace environment (docs/lora-dpo.md)
    assert r0["quantized"] == r1["quantized"] == r0["ref_quantized"] == 14  # 7 linears x 2 layers
    assert r0["local_type"] == r1["local_type"] == "NF4Tensor"
    torch.testing.assert_close(r0["loss"] + r1["loss"], r0["ref_loss"], rtol=1e-5, atol=1e-6)
    assert r0["grad_names_equal"] and r0["grad_max_diff"] < 1e-6
    assert r0["merged_keys_equal"] and r0["merged_max_diff"] < 1e-6
    for r in (r0, r1):  # another model's NF4 base, then the checkpoint's: the same loss again
        assert r["other_loss"] != r["loss"] and r["loss_after_resume"] == r["loss"]
