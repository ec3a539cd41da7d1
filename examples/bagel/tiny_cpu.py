"""Tiny BAGEL on CPU: learns to describe and to draw coloured shapes, in about a minute.

    uv run --all-packages --all-extras python examples/bagel/tiny_cpu.py [--steps 300] [--out DIR] [--muon]

Generated data (shapes with captions, in the chat-record format): each record is either
*understanding* (user: image + "what is this?", assistant: "a red square") or *generation*
(user: "draw a red square", assistant: the image). lmms-data's ``bagel`` processor turns records
into parts, lmms-models' packer packs 8 samples per row, the objective ``ce_flow_matching`` trains
both heads (cross-entropy on the captions, flow matching on the image latents). Latents are
pixel space (average-pooled by 4, the tiny stand-in for the VAE), 32 x 32 px -> 8 x 8 x 3 latents
-> 16 latent tokens per image. Prints the caption cross-entropy, the flow-matching loss and
caption accuracy every 25 steps, and writes ``render.png`` (one image per colour/shape prompt,
drawn by the sampler) at the end.

This script drives the pieces directly (a 30-line loop): lmms-train does not yet read BAGEL rows
(see docs/bagel.md, "Status").
"""

from __future__ import annotations

import argparse
import io
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

import lmms_data
from lmms_models import get_model_spec
from lmms_models.families.bagel import pack_samples, pixel_space_latents
from lmms_models.families.bagel._sample import generate_latents
from lmms_models.objectives import ObjectiveContext, get_objective

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (40, 70, 220)}
SHAPES = ("square", "circle")
SIDE, FACTOR = 32, 4


def shape_png(colour: str, shape: str) -> bytes:
    img = Image.new("RGB", (SIDE, SIDE), (255, 255, 255))
    box = (6, 6, SIDE - 6, SIDE - 6)
    draw = ImageDraw.Draw(img)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def record(rng: random.Random) -> list[dict]:
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    img = {"type": "image", "image": shape_png(colour, shape)}
    caption = f"a {colour} {shape}"
    if rng.random() < 0.5:
        return [{"role": "user", "content": [img, {"type": "text", "text": "what is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": caption}]}]  # fmt: skip
    return [{"role": "user", "content": [{"type": "text", "text": f"draw {caption}"}]},
            {"role": "assistant", "content": [img]}]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--muon", action="store_true", help="lmms_optim.Muon on the hidden matrices")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny matmuls: more threads only add synchronisation
    out = Path(args.out or tempfile.mkdtemp(prefix="bagel_tiny_"))
    out.mkdir(parents=True, exist_ok=True)
    info = lmms_data.build_local_processor(str(out / "tokenizer"), "qwen2_5_vl")
    proc = lmms_data.PROCESSOR_REGISTRY.get("bagel")(
        info["path"], vit_patch_size=4, max_vit_side=SIDE, latent_downsample=FACTOR * 2,
        max_gen_side=SIDE,
    )  # fmt: skip
    spec = get_model_spec("bagel")
    conf = spec.tiny_config(latent_channels=3, vae_downsample=FACTOR, latent_patch_size=2,
                            llm={"vocab_size": info["vocab_size"]})  # fmt: skip
    model = spec.build(config=conf)
    cfg = spec.make_config(conf)
    obj = get_objective("ce_flow_matching", ce_weight=1.0, fm_weight=1.0)
    if args.muon:  # Muon for the decoder/ViT matrices; AdamW for embeddings, heads, projections
        from lmms_optim import Muon, build_muon_param_groups

        io_modules = [model.language_model.lm_head, model.vae2llm, model.llm2vae,
                      model.connector, model.time_embedder, model.vit_model.vision_model.embeddings]  # fmt: skip
        groups = build_muon_param_groups(model, lr=0.02, adamw_lr=2e-3, adamw_modules=io_modules)
        opt: torch.optim.Optimizer = Muon(groups)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    rng = random.Random(0)
    encode = pixel_space_latents(FACTOR)
    soi, eoi = proc.start_of_image, proc.end_of_image
    t0 = time.time()
    for step in range(1, args.steps + 1):
        samples = [proc(record(rng))["parts"] for _ in range(8)]
        seeds = [step * 8 + i for i in range(8)]
        row = pack_samples(samples, cfg, start_of_image=soi, end_of_image=eoi, seeds=seeds,
                           encode=encode)  # fmt: skip
        res = obj.loss(spec, model, row, ObjectiveContext(seed=0, step=step))
        (res.loss_sum / max(1, int(res.count))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1 or step % 25 == 0:
            ce = float(res.metrics["ce"][0] / res.metrics["ce"][1].clamp(min=1))
            fm = float(res.metrics["fm"][0] / res.metrics["fm"][1].clamp(min=1))
            print(
                f"step {step:4d}  ce {ce:.3f}  fm {fm:.4f}  ({time.time() - t0:.0f}s)", flush=True
            )

    # captions: greedy next-token accuracy on fresh understanding records
    model.eval()
    tiles = []
    for colour in COLOURS:
        for shape in SHAPES:
            prompt = proc([{"role": "user", "content": [{"type": "text", "text": f"draw a {colour} {shape}"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": ""}]}])["parts"]  # fmt: skip
            prompt = prompt[:-2]  # up to "<|im_start|>assistant\n"
            lat = generate_latents(model, prompt, (3, SIDE // FACTOR, SIDE // FACTOR),
                                   start_of_image=soi, end_of_image=eoi, steps=20)  # fmt: skip
            px = torch.nn.functional.interpolate(lat[None], scale_factor=FACTOR, mode="nearest")[0]
            tiles.append(((px.clamp(-1, 1) + 1) * 127.5).byte().permute(1, 2, 0).numpy())
    grid = np.concatenate(tiles, axis=1)
    Image.fromarray(grid).save(out / "render.png")
    print(f"render: {out / 'render.png'} (red/green/blue x square/circle, left to right)")


if __name__ == "__main__":
    main()
