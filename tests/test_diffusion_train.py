"""Diffusion transformers through the trainer (in this process, tiny examples on CPU): SiT's
resume replays noise, timesteps and CFG drops bit for bit (losses equal a straight run), the
render command draws a class grid; Wan trains with its frozen encoders on the fly, renders a
clip, precomputes latents + text embeddings to Parquet, and trains from those shards. BAGEL
(ce_flow_matching): resume bit for bit incl. EMA and noise draws, a prompt rendered to a PNG.
(FSDP2 on 2 ranks == 1 process for Wan and BAGEL: tests/test_cli_layouts.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_helpers import bagel_args, step_rows

from lmms_train import train
from lmms_train.config import load_config

pytest.importorskip("diffusers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _cfg(example: str, tmp: Path, out: str, *extra: str):
    return load_config(EXAMPLES / example, [
        f"dataset_config.dataset_path={tmp / 'data'}", "dataset_config.generate_synthetic.num_samples=64",
        f"trainer_args.output_dir={tmp / out}", "trainer_args.report_to=[]",
        "trainer_args.eval_steps=0", *extra,
    ])  # fmt: skip


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in step_rows(run)}


def test_sit_resume_is_bitwise_and_render_draws_a_grid(tmp_path: Path) -> None:
    from PIL import Image

    from lmms_train.cli import main

    small = ("dataset_config.extra.batch_size=8", "trainer_args.ema_decay=0.9")
    train(_cfg("sit/tiny_cpu.yaml", tmp_path, "straight", "trainer_args.max_steps=4",
               "trainer_args.save_steps=0", *small))  # fmt: skip
    train(_cfg("sit/tiny_cpu.yaml", tmp_path, "resumed", "trainer_args.max_steps=2",
               "trainer_args.save_steps=2", "trainer_args.export_hf=false", *small))  # fmt: skip
    train(_cfg("sit/tiny_cpu.yaml", tmp_path, "resumed", "trainer_args.max_steps=4",
               "trainer_args.resume_from=latest", *small))  # fmt: skip
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert [straight[s] for s in (3, 4)] == [resumed[s] for s in (3, 4)]
    rows = [
        json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any(k.startswith("loss_t/") for k in rows[-1]), rows[-1]  # loss per noise-level bucket
    assert (tmp_path / "straight" / "metrics.png").is_file()  # with the loss_t panel
    from safetensors.torch import load_file

    ema = [
        load_file(str(tmp_path / r / "hf_ema" / "model.safetensors"))
        for r in ("straight", "resumed")
    ]
    raw = load_file(str(tmp_path / "straight" / "hf" / "model.safetensors"))
    assert all(ema[0][k].equal(ema[1][k]) for k in raw)  # EMA resumed bit for bit
    assert any(not ema[0][k].equal(raw[k]) for k in raw)
    grid = tmp_path / "grid.png"
    assert main(["render", str(tmp_path / "straight" / "hf"), "--out", str(grid), "--steps", "2",
                 "--per-class", "2", "--method", "heun", "--guidance", "2"]) == 0  # fmt: skip
    assert Image.open(grid).size == (2 * 16 * 4, 4 * 16 * 4)  # 4 classes x 2, upscaled x4


def test_ema_is_the_average_of_the_optimizer_steps() -> None:
    import torch

    from lmms_train._ema import ema_weights, install_ema

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([p], lr=0.5)
    install_ema(opt, 0.8)
    want = None
    for i in range(4):
        p.grad = torch.tensor([1.0, float(i)])
        opt.step()
        want = p.detach().clone() if want is None else 0.8 * want + 0.2 * p.detach()
    torch.testing.assert_close(opt.state[p]["lmms_ema"], want)
    before = p.detach().clone()
    with ema_weights(opt) as n:
        assert n == 1 and torch.equal(p.detach(), opt.state[p]["lmms_ema"])
    assert torch.equal(p.detach(), before)
    assert "lmms_ema" in opt.state_dict()["state"][0]  # saved and loaded with the optimizer


def test_wan_on_the_fly_render_precompute_and_train_from_shards(tmp_path: Path) -> None:
    from lmms_train.cli import main

    proc = f"model_config.processor_path={tmp_path / 'processor'}"
    small = ("dataset_config.extra.batch_size=4", "trainer_args.max_steps=2",
             "trainer_args.save_steps=0", proc)  # fmt: skip
    train(_cfg("wan/tiny_cpu.yaml", tmp_path, "fly", *small))
    assert len(_losses(tmp_path / "fly")) == 2
    gif = tmp_path / "clip.gif"
    assert main(["render", str(tmp_path / "fly" / "hf"), "--out", str(gif), "--steps", "2",
                 "--processor", str(tmp_path / "processor"), "--prompt", "a red circle moving left",
                 "--frames", "5", "--height", "16", "--width", "16"]) == 0  # fmt: skip
    assert gif.stat().st_size > 0
    shards = tmp_path / "latents"
    cfg_path = EXAMPLES / "wan" / "tiny_cpu.yaml"
    assert main(["precompute", str(cfg_path), "--out", str(shards), "--rows-per-shard", "40",
                 f"dataset_config.dataset_path={tmp_path / 'data'}", proc]) == 0  # fmt: skip
    import pyarrow.parquet as pq

    table = pq.read_table(str(shards))
    assert table.num_rows == 64 and set(table.column_names) == {"latents", "text_embeds"}
    train(_cfg("wan/tiny_cpu.yaml", tmp_path, "shards", *small,
               f"dataset_config.dataset_path={shards}"))  # fmt: skip
    assert len(_losses(tmp_path / "shards")) == 2


def test_frozen_encoders_are_checked_before_training(tmp_path: Path, capsys) -> None:
    """`frozen_encoders: shard` on one process without FSDP, or any placement on a family without
    a placeable encoder (sit: its VAE only), is a config error naming the key (before any step)."""
    from e2e_helpers import expect_failure

    from lmms_train.cli import main

    base = [f"dataset_config.dataset_path={tmp_path / 'data'}",
            "dataset_config.generate_synthetic.num_samples=16",
            f"trainer_args.output_dir={tmp_path / 'run'}", "trainer_args.report_to=[]",
            "trainer_args.frozen_encoders=shard", "trainer_args.fsdp=false"]  # fmt: skip
    expect_failure(main, [str(EXAMPLES / "wan" / "tiny_cpu.yaml"), *base,
                          f"model_config.processor_path={tmp_path / 'processor'}"],
                   capsys, "frozen_encoders: shard needs FSDP")  # fmt: skip
    expect_failure(main, [str(EXAMPLES / "sit" / "tiny_cpu.yaml"), *base[1:-2],
                          f"dataset_config.dataset_path={tmp_path / 'shapes'}",
                          "trainer_args.frozen_encoders=offload"],
                   capsys, "frozen_encoders: offload is for families with a frozen text")  # fmt: skip


# ---------------------------------------------------------------- BAGEL (ce_flow_matching)
def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in step_rows(run)}


def test_bagel_resume_is_bitwise_with_ema_and_render_draws_png(
    bagel_straight: Path, capsys
) -> None:
    """Save at step 1, resume to 3: losses, the separately logged `ce` / `fm` terms and the EMA
    weights equal the straight run's bit for bit (the data position, the per-record noise seeds
    and the EMA in the optimizer state all replay); `lmms-train render` draws one PNG tile per
    prompt from the export; `lmms-train check-data` reads the same records."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from lmms_train.cli import main

    tmp = bagel_straight
    common = ("trainer_args.gradient_accumulation_steps=2", "dataset_config.num_workers=2")
    train(load_config(EXAMPLES / "bagel" / "tiny_cpu.yaml", bagel_args(tmp, "resumed",
          "trainer_args.max_steps=1", "trainer_args.save_steps=1", "trainer_args.export_hf=false",
          *common)))  # fmt: skip
    train(load_config(EXAMPLES / "bagel" / "tiny_cpu.yaml", bagel_args(tmp, "resumed",
          "trainer_args.max_steps=3", "trainer_args.resume_from=latest", *common)))  # fmt: skip
    straight, resumed = _rows(tmp / "straight"), _rows(tmp / "resumed")
    for step in (2, 3):
        for key in ("loss", "ce", "fm"):
            assert straight[step][key] == resumed[step][key], (step, key)
    assert all(r["ce"] > 0 and r["fm"] > 0 and r["vision_tokens"] > 0 for r in straight.values())
    assert all(0 < r["mfu_lm"] < r["mfu"] for r in straight.values())  # + ViT, latent projections
    ema = [
        load_file(str(tmp / r / "hf_ema" / "model.safetensors")) for r in ("straight", "resumed")
    ]
    raw = load_file(str(tmp / "straight" / "hf" / "model.safetensors"))
    assert ema[0].keys() == raw.keys() and all(ema[0][k].equal(ema[1][k]) for k in raw)
    assert any(not ema[0][k].equal(raw[k]) for k in raw)
    assert json.loads((tmp / "straight" / "hf" / "config.json").read_text())["vae"] == "pixel_space"
    png = tmp / "draw.png"
    assert main(["render", str(tmp / "straight" / "hf"), "--out", str(png), "--steps", "2",
                 "--guidance", "2", "--prompt", "draw a red square",
                 "--prompt", "draw a blue circle"]) == 0  # fmt: skip
    img = Image.open(png)
    assert img.size == (2 * 32 * 4, 32 * 4)  # two 32 x 32 tiles, upscaled x4
    assert np.asarray(img).std() > 0  # not a blank canvas
    capsys.readouterr()
    args = bagel_args(tmp, "unused")
    assert main(["check-data", str(EXAMPLES / "bagel" / "tiny_cpu.yaml"), *args,
                 "--num-records", "20"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "20 good, 0 bad" in out and "<|vision_start|>" in out, out


@pytest.mark.gpu
def test_bagel_trains_on_the_gpu_like_on_the_cpu(bagel_straight: Path) -> None:
    """The tiny example on CUDA (FlexAttention compiled over rows padded to packing_length, the
    trainer's GPU path) follows the CPU run's losses over its 3 steps (fp32; kernels differ)."""
    tmp = bagel_straight
    train(load_config(EXAMPLES / "bagel" / "tiny_cpu.yaml", [
        *bagel_args(tmp, "gpu", "trainer_args.max_steps=3", "trainer_args.save_steps=0",
                     "trainer_args.gradient_accumulation_steps=2", "dataset_config.num_workers=2",
                     "trainer_args.export_hf=false"),
        "trainer_args.device=cuda",
    ]))  # fmt: skip
    want, got = _rows(tmp / "straight"), _rows(tmp / "gpu")
    for step in (1, 2, 3):
        for key in ("loss", "ce", "fm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=5e-3), (step, key)
