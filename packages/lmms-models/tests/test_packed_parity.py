"""Packed forward == Σ over samples of the upstream model's own unpacked forward (loss and grads).

Each pack mixes text-only samples, a length-1 segment, several images, video, and tail padding.
The reference runs every sample alone through ``model(input_ids=..., labels=..., pixel_values=...)``
with upstream attention; the packed forward uses lmms varlen attention (SDPA-per-segment backend).
"""

from __future__ import annotations

import pytest
import torch
from _parity import (
    assert_loss_matches,
    one_segment_loss,
    packed_step,
    padded_pack,
    reference_grads,
)

from lmms_models import get_model_spec, linear_patch_embed
from lmms_models.testing import SampleSpec, make_sample, pack_samples, reference_loss_sum
from lmms_parallel.testing import full_grads

TEXT_FAMILIES = ["qwen2", "qwen2_5", "qwen3", "qwen3_moe", "llama"]
VL_FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
#: every family that takes images and video: the Qwen-VL lineage and families laid out otherwise
MEDIA_FAMILIES = [*VL_FAMILIES, "llava_onevision"]


def _samples(spec):
    ss = [SampleSpec(text=12), SampleSpec(text=1, prompt=0), SampleSpec(text=7, prompt=3)]
    if "pixel_values" in spec.media_keys:
        ss += [
            SampleSpec(text=6, images=[(1, 4, 4), (1, 2, 6)]),
            SampleSpec(text=5, videos=[(2, 4, 4)]),
            SampleSpec(text=3, images=[(1, 6, 4)], videos=[(3, 2, 2)]),
        ]
    return ss


def tiny_pack(name: str, n_samples: int | None = None):
    """(spec, tiny model with varlen SDPA, one packed row of the family's test samples)."""
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    gen = torch.Generator().manual_seed(1)
    samples = [make_sample(spec, model.config, s, gen=gen) for s in _samples(spec)[:n_samples]]
    return spec, model, pack_samples(spec, model, samples)


def _check(name: str, reference_attn: str):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build(config=spec.tiny_config(), attn_backend=reference_attn)
    gen = torch.Generator().manual_seed(1)
    samples = [make_sample(spec, model.config, s, gen=gen) for s in _samples(spec)]
    ref, n_ref = reference_loss_sum(spec, model, samples)
    g_ref = reference_grads(model, ref)
    batch = padded_pack(spec, model, samples)
    names = spec.set_attention(model, backend="varlen_sdpa")
    assert "flash" in names["vision"]  # Qwen-VL towers pass cu_seqlens only to "flash" names
    loss, count, g_packed = packed_step(spec, model, batch)
    assert_loss_matches(loss, count, ref, n_ref, batch)
    assert g_packed.keys() == g_ref.keys()
    tower = spec.vision_tower(model)
    if tower is not None:  # the tower's parameters got gradients too
        assert {id(p) for p in tower.parameters()} & {
            id(p) for k, p in model.named_parameters() if k in g_packed
        }
    for k in g_ref:
        torch.testing.assert_close(g_packed[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    return spec, model, batch, loss


@pytest.mark.parametrize("name", TEXT_FAMILIES + MEDIA_FAMILIES)
def test_packed_matches_unpacked_upstream(name):
    spec, model, batch, loss = _check(name, "sdpa")
    # The check can fail: one segment for the whole row (cross-sample attention) changes the loss.
    assert not torch.allclose(one_segment_loss(spec, model, batch), loss, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_5_vl"])
def test_packed_matches_unpacked_eager(name):
    _check(name, "eager")


def test_text_kwargs_do_not_reach_vision_tower():
    """The pack's cu_seqlens must reach the text attention only; the vision tower keeps its own."""
    from transformers import AttentionInterface

    spec = get_model_spec("qwen2_5_vl")
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    gen = torch.Generator().manual_seed(0)
    samples = [make_sample(spec, model.config, SampleSpec(text=4, images=[(1, 4, 4)]), gen=gen)] * 2
    batch = pack_samples(spec, model, samples)
    seen: dict[str, list[int]] = {"text": [], "vision": []}
    names = spec.set_attention(model, backend="varlen_sdpa")
    for tower in ("text", "vision"):
        inner = AttentionInterface._global_mapping[names[tower]]

        def spy(module, q, k, v, *a, _inner=inner, _tower=tower, **kw):
            seen[_tower].append(int(kw["cu_seq_lens_q"][-1]))
            return _inner(module, q, k, v, *a, **kw)

        AttentionInterface.register(names[tower], spy)
    try:
        with torch.no_grad():
            spec.packed_forward(model, batch)
    finally:
        spec.set_attention(model, backend="varlen_sdpa")  # re-registers the plain functions
    assert seen["text"] == [batch["input_ids"].numel()] * 2  # 2 decoder layers, whole pack
    assert seen["vision"] == [32] * 3  # 3 blocks, 2 images of 16 patches


# per VL family: the upstream helper whose precomputed input shows the tower took the host values
_HOST_CHECK = {
    "qwen2_5_vl": ("get_vision_window_index", "window_index"),
    "qwen3_vl": ("get_vision_interpolation_indices_and_weights", "interp_indices"),
    "qwen3_vl_moe": ("get_vision_interpolation_indices_and_weights", "interp_indices"),
}


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_vision_inputs_precomputed_on_the_host(name, monkeypatch):
    """With the grids on the host, the tower gets the inputs it derives from them (rotary ids,
    cu_seqlens, windows or position-embedding interpolation) computed there (no device
    synchronisation on a GPU), the decoder does not see them, and the step is bit-identical to
    the tower computing them itself from the grids."""
    import importlib

    spec = get_model_spec(name)
    if not spec.host_keys:
        pytest.skip("this transformers does not accept precomputed vision inputs")
    upstream = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    helper, key = _HOST_CHECK[name]
    spec, model, batch = tiny_pack(name)
    given = []
    real = getattr(upstream, helper)

    def spy(*args, kwargs=None, **kw):
        given.append(kwargs is not None and key in kwargs)
        return real(*args, kwargs=kwargs, **kw)

    monkeypatch.setattr(upstream, helper, spy)
    layer_kwargs = []
    spec.decoder_blocks(model)[0].register_forward_pre_hook(
        lambda _m, _a, kw: layer_kwargs.append(set(kw)), with_kwargs=True
    )

    loss, _, grads = packed_step(spec, model, batch)
    assert given and all(given), given  # images and videos: every tower call took host values
    assert not any(k in layer_kwargs[0] for k in (key, "cu_seqlens", "grid_thw"))
    calls = len(given)
    given.clear()
    monkeypatch.setattr(spec, "host_keys", ())  # the tower computes them from the grids
    ref_loss, _, ref_grads = packed_step(spec, model, batch)
    assert given == [False] * calls, given
    assert torch.equal(loss, ref_loss)
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), k


@pytest.mark.parametrize("name", TEXT_FAMILIES + VL_FAMILIES)
def test_mask_mapping_skips_packed_sequence_detection(name, monkeypatch):
    """No family's packed forward lets transformers look for packed sequences in
    `position_ids` (a host read of a device value): it hands the decoder prepared (empty) masks
    (`mask_mapping`, or an empty prepared mask in its `media_context`, e.g. qwen3_moe, llama),
    or its positions without the text row (`mrope_rows_only`)."""
    import transformers.masking_utils as mu

    calls = []
    real = mu.find_packed_sequence_indices

    def spy(position_ids):
        calls.append(1)
        return real(position_ids)

    monkeypatch.setattr(mu, "find_packed_sequence_indices", spy)
    spec, model, batch = tiny_pack(name, 3)
    spec.packed_forward(model, batch)
    assert not calls, (name, len(calls))


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_media_merged_at_host_positions(name, monkeypatch):
    """`host_merge` families place the media features with positions read on the host (no
    `masked_scatter`: its count check and its backward's `masked_select` read the device);
    loss and gradients are bit-identical to the upstream merge, and a placeholder count that
    does not match the features is refused on the host."""
    from torch.overrides import TorchFunctionMode

    class Spy(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    spec, model, batch = tiny_pack(name)

    def step():
        model.zero_grad(set_to_none=True)
        with Spy() as spy:
            loss, _ = spec.packed_forward(model, batch)
            loss.backward()
        return loss.detach(), full_grads(model), spy.names

    # upstream's placeholder check and (Qwen3-VL) its boolean-mask deepstack step, counted
    base_cls = type(spec.base_model(model))
    reached = {"get_placeholder_mask": 0, "deepstack_by_mask": 0}

    def counted(key, real):
        def spy(*args, **kwargs):
            reached[key] += 1
            return real(*args, **kwargs)

        return spy

    monkeypatch.setattr(
        base_cls,
        "get_placeholder_mask",
        counted("get_placeholder_mask", base_cls.get_placeholder_mask),
    )
    text_cls = type(spec.text_model(model))
    if hasattr(text_cls, "_deepstack_process"):
        real = text_cls._deepstack_process
        monkeypatch.setattr(text_cls, "_deepstack_process", counted("deepstack_by_mask", real))

    loss, grads, names = step()
    assert ("masked_scatter" in names) != spec.host_merge, name
    if not spec.host_merge:
        return
    assert "index_copy" in names
    assert reached == {"get_placeholder_mask": 0, "deepstack_by_mask": 0}, reached
    if name.startswith("qwen3_vl"):
        assert "index_add" in names  # deepstack at host positions
    monkeypatch.setattr(spec, "host_merge", False)  # upstream's masked_scatter merge
    ref_loss, ref_grads, ref_names = step()
    assert "masked_scatter" in ref_names
    assert reached["get_placeholder_mask"] == 2  # images, videos
    assert reached["deepstack_by_mask"] == (
        len(model.config.vision_config.deepstack_visual_indexes)
        if name.startswith("qwen3_vl")
        else 0
    )
    assert torch.equal(loss, ref_loss)
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), k
    monkeypatch.setattr(spec, "host_merge", True)
    bad = dict(batch, mm_token_type_ids=batch["mm_token_type_ids"].clone())
    first = int((bad["mm_token_type_ids"].reshape(-1) == 1).nonzero()[0])
    bad["mm_token_type_ids"].reshape(-1)[first] = 0
    with pytest.raises(ValueError, match="image features and image placeholder tokens"):
        spec.packed_forward(model, bad)


def test_a_vision_tower_on_its_own_backend_gives_the_same_packed_loss():
    """Text on lmms' SDPA-per-segment, the tower on its upstream attention (transformers' own
    split by ``cu_seqlens``): the same loss and vision grads as both on SDPA-per-segment."""
    spec, model, batch = tiny_pack("qwen2_5_vl")
    loss_ref, _, g_ref = packed_step(spec, model, batch)
    names = spec.set_attention(model, backend="varlen_sdpa", vision_backend="sdpa")
    assert names == {"text": "lmms_flash_text_varlen_sdpa", "vision": "sdpa"}
    loss, _, g = packed_step(spec, model, batch)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    visual = [k for k in g_ref if ".visual." in k or k.startswith("model.visual")]
    assert visual
    for k in visual:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_linear_patch_embed_equals_the_convolution(name):
    spec, model, batch = tiny_pack(name)
    tower = spec.vision_tower(model)
    embed = tower.patch_embed
    keys = list(model.state_dict())
    x = torch.randn(37, embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(2))
    ref = embed(x)
    loss_ref, _, g_ref = packed_step(spec, model, batch)

    handle = linear_patch_embed(tower)
    assert handle.module is embed and "forward" in vars(embed)
    torch.testing.assert_close(embed(x), ref, rtol=1e-5, atol=1e-6)
    loss, _, g = packed_step(spec, model, batch)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert set(g) == set(g_ref)
    for k in g_ref:
        torch.testing.assert_close(
            g[k], g_ref[k], rtol=1e-4, atol=1e-5, msg=k
        )  # fp32 sums reordered
    assert list(model.state_dict()) == keys  # parameters untouched: checkpoints do not change

    handle.remove()
    assert "forward" not in vars(embed) and handle.module is None
    torch.testing.assert_close(embed(x), ref, rtol=0, atol=0)


def test_linear_patch_embed_leaves_other_modules_alone():
    assert linear_patch_embed(None).module is None  # a text model has no tower
    spec = get_model_spec("qwen2_5_vl")
    model = spec.build(config=spec.tiny_config(), attn_backend="varlen_sdpa")
    tower = spec.vision_tower(model)
    proj = tower.patch_embed.proj
    padded = torch.nn.Conv3d(
        proj.in_channels, proj.out_channels, proj.kernel_size, stride=proj.stride, padding=1
    )
    tower.patch_embed.proj = padded  # a window per patch no longer: not a matrix product
    assert linear_patch_embed(tower).module is None
    assert "forward" not in vars(tower.patch_embed)
