"""LLaVA-OneVision end to end: lmms-data's processor and lmms-models' family agree.

The processor's placeholder counts equal the model's own feature layout (upstream's
``pack_image_features``) over sizes and aspect ratios; the tiny processor matches the tiny model
config; and a pack of processed records (single image, multi-image, video, text) gives the packed
forward the same loss and gradients as the upstream model on each record alone. (FSDP2 and SP 2
through the CLI: tests/test_cli_layouts.py.)
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import lmms_data as ld
from lmms_data.processors._local_llava import TINY_LLAVA
from lmms_models import get_model_spec
from lmms_models.testing import reference_loss_sum


def _png(h, w, seed=0):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _video(path, n=3, h=40, w=60):
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            frame = np.full((h, w, 3), 40 * i, dtype=np.uint8)
            c.mux(s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        c.mux(s.encode())
    return str(path)


def _chat(parts, answer="A red circle."):
    user = [{"type": k, k: v} for k, v in parts] + [{"type": "text", "text": "What is it?"}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    info = ld.build_local_processor(str(tmp_path_factory.mktemp("llava")), "llava_onevision")
    spec = get_model_spec("llava_onevision")
    ids = {k: info[k] for k in ("image_token_id", "video_token_id")}
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(**ids), attn_backend="sdpa")
    return info, spec, model


def test_processor_counts_equal_the_model_layout(setup):
    info, spec, model = setup
    cfg = model.config
    v = cfg.vision_config
    assert TINY_LLAVA["view"] == v.image_size
    assert TINY_LLAVA["num_image_tokens"] == (v.image_size // v.patch_size) ** 2
    assert TINY_LLAVA["pinpoints"] == cfg.image_grid_pinpoints
    assert TINY_LLAVA["vision_aspect_ratio"] == cfg.vision_aspect_ratio
    p = ld.build_processor("llava_onevision", info["path"])
    for h in (20, 33, 53, 96, 150, 300):
        for w in (20, 35, 64, 97, 300):
            for multi in (False, True):
                want = spec.image_tokens(cfg, (h, w), multi=multi)
                assert p.image_tokens(h, w, multi=multi) == want, (h, w, multi)


def test_processed_pack_matches_upstream_per_record(setup, tmp_path):
    info, spec, model = setup
    p = ld.build_processor("llava_onevision", info["path"], video_fps=4.0, video_max_frames=3)
    records = [
        _chat([("image", _png(53, 35))]),
        _chat([("image", _png(20, 30, 1)), ("image", _png(40, 30, 2))], "Two blue squares."),
        _chat([("video", _video(tmp_path / "v.mp4"))], "It moves."),
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
    ]  # fmt: skip
    samples = [p(r) for r in records]
    batch = ld.collate_packed_batch(samples, pad_to_multiple_of=8)
    torch_samples = []
    for s in samples:
        t = {k: torch.as_tensor(v) for k, v in s.items() if isinstance(v, np.ndarray)}
        torch_samples.append(t)
    ref, n_ref = reference_loss_sum(spec, model, torch_samples)
    ref.backward()
    g_ref = {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    spec.set_attention(model, backend="varlen_sdpa")
    try:
        loss, n = spec.packed_forward(model, batch)
        loss.backward()
    finally:
        spec.set_attention(model, backend="sdpa")
    assert int(n) == n_ref
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    for k, g in g_ref.items():
        torch.testing.assert_close(model.get_parameter(k).grad, g, rtol=1e-4, atol=1e-6, msg=k)
    model.zero_grad(set_to_none=True)


def test_vision_imbalance_is_max_over_mean():
    from types import SimpleNamespace

    from lmms_train._step_metrics import vision_imbalance

    env = SimpleNamespace(dp_size=4)
    assert vision_imbalance(6.0, 12.0, env) == {"perf/vision_flops_imbalance": 2.0}
    assert vision_imbalance(0.0, 0.0, env) == {}  # no media this step


def test_released_processor_settings_match_the_presets():
    from lmms_data.processors._local_llava import RELEASED_LLAVA

    spec = get_model_spec("llava_onevision")
    for name in ("0.5b", "7b"):
        cfg = spec.make_config(spec.preset(name))
        v = cfg.vision_config
        assert RELEASED_LLAVA["view"] == v.image_size, name
        assert RELEASED_LLAVA["num_image_tokens"] == (v.image_size // v.patch_size) ** 2 == 729
        assert RELEASED_LLAVA["pinpoints"] == cfg.image_grid_pinpoints, name
        assert RELEASED_LLAVA["vision_aspect_ratio"] == cfg.vision_aspect_ratio, name


def test_resume_reproduces_the_straight_run(tmp_path):
    """A checkpoint of the tiny example resumes (SigLIP's post_layernorm, which LLaVA-OneVision
    never reads, is frozen, so the optimizer holds state for every trainable parameter) and the
    resumed step's loss equals the straight run's."""
    import yaml
    from e2e_helpers import REPO, write_config

    from lmms_train._metrics import read_jsonl
    from lmms_train.cli import main

    cfg = yaml.safe_load((REPO / "examples/llava_onevision/tiny_cpu.yaml").read_text())
    cfg["model_config"]["processor_path"] = str(tmp_path / "processor")
    d = cfg["dataset_config"]
    d.update(dataset_path=str(tmp_path / "data"), packing_length=384, num_workers=0)
    d["generate_synthetic"] = {"num_samples": 48}
    t = cfg["trainer_args"]
    t.update(output_dir=str(tmp_path / "a"), max_steps=3, save_steps=2, eval_steps=0,
             report_to=[], export_hf=False)  # fmt: skip
    path = write_config(cfg, tmp_path / "c.yaml")
    assert main([str(path)]) == 0
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert ckpt.is_dir()
    out_b = f"trainer_args.output_dir={tmp_path / 'b'}"
    assert main([str(path), out_b, f"trainer_args.resume_from={ckpt}"]) == 0

    def losses(name):
        return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")
                if "loss" in r}  # fmt: skip

    straight, resumed = losses("a"), losses("b")
    assert 3 in resumed and resumed[3] == straight[3], (straight, resumed)
