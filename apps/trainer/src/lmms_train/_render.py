"""Rendering trained diffusion checkpoints (ODE sampling) and precomputing latents.

See `lmms_train._diffusion_cli` for the commands. Sampling follows the run's flow-matching
options (path, prediction, convention, shift); Euler or Heun steps, classifier-free guidance with
the family's null condition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["precompute", "render_bagel", "render_sit", "render_wan", "sample_latents"]

_SCALE = 4  # upscaling of tiny renders (nearest) so they can be looked at


def sample_latents(
    spec: Any, model: Any, cfg: Any, cond: Any, shape: tuple[int, ...], *, steps: int,
    method: str, guidance: float, seed: int,
) -> torch.Tensor:  # fmt: skip
    """Latents ``[B, *shape]`` for conditions ``cond`` (batch of B) from seeded noise."""
    from lmms_models._flow_matching import ode_sample

    device = next(model.parameters()).device
    b = cond.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn((b, *shape), generator=gen).to(device)
    null = spec.null_condition(model, b, device)

    def net(x: torch.Tensor, t: torch.Tensor, uncond: bool) -> torch.Tensor:
        return spec.denoise(model, x, t, null if uncond else cond)

    return ode_sample(cfg, net, noise, steps=steps, method=method, guidance=guidance)


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().byte().cpu().numpy()


def render_sit(
    spec: Any, model: Any, cfg: Any, out: str, *, classes: list[int] | None, per_class: int,
    steps: int, method: str, guidance: float, seed: int,
) -> Path:  # fmt: skip
    """A PNG grid: one row per class, ``per_class`` samples each."""
    from lmms_models import get_encoder

    conf = model.config
    device = next(model.parameters()).device
    classes = list(range(conf.num_classes)) if classes is None else classes
    y = torch.tensor(classes, device=device).repeat_interleave(per_class)
    vae = get_encoder(model, "vae", device)
    side = conf.input_size
    x = sample_latents(spec, model, cfg, y, (conf.in_channels, side, side), steps=steps,
                       method=method, guidance=guidance, seed=seed)  # fmt: skip
    if vae is not None:
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        x = vae.decode(x / vae.config.scaling_factor + shift).sample
    imgs = _to_uint8(x).transpose(0, 2, 3, 1)  # [N, H, W, 3]
    h, w = imgs.shape[1:3]
    grid = np.zeros((len(classes) * h, per_class * w, 3), np.uint8)
    for i, img in enumerate(imgs):
        r, c = divmod(i, per_class)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = img
    pil = Image.fromarray(grid).resize((grid.shape[1] * _SCALE, grid.shape[0] * _SCALE),
                                       Image.NEAREST)  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pil.save(out)
    return Path(out)


def _text(model: Any, prompts: list[str], processor: str | None, device: Any) -> torch.Tensor:
    from lmms_models import get_encoder
    from lmms_models.families.wan import encode_text

    enc = get_encoder(model, "text_encoder", device)
    if enc is None or processor is None:
        if any(prompts):
            raise ValueError("render: prompts need the model's text encoder and --processor DIR")
        return torch.zeros(len(prompts), 1, model.config.text_dim, device=device)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(processor, local_files_only=True)
    t = tok(prompts, max_length=64, padding="max_length", truncation=True, return_tensors="pt")
    return encode_text(enc, t["input_ids"].to(device), t["attention_mask"].to(device))


def render_wan(
    spec: Any, model: Any, cfg: Any, out: str, *, prompts: list[str], processor: str | None,
    shape: tuple[int, int, int], steps: int, method: str, guidance: float, seed: int,
) -> Path:  # fmt: skip
    """A GIF or MP4 of one clip per prompt, side by side (``shape``: frames, height, width)."""
    from lmms_models import get_encoder
    from lmms_models.families.wan import vae_factors

    device = next(model.parameters()).device
    vae = get_encoder(model, "vae", device)
    if vae is None:
        raise ValueError("render: this checkpoint has no VAE to decode its latents")
    ft, fs = vae_factors(vae)
    f, h, w = shape
    lat = (vae.config.z_dim, 1 + (f - 1) // ft, h // fs, w // fs)
    cond = _text(model, prompts, processor, device)
    z = sample_latents(spec, model, cfg, cond, lat, steps=steps, method=method,
                       guidance=guidance, seed=seed)  # fmt: skip
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    video = vae.decode(z * std + mean).sample  # [B, 3, F, H, W]
    frames = np.concatenate(list(_to_uint8(video).transpose(0, 2, 3, 4, 1)), axis=2)  # [F,H,BW,3]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if out.endswith(".mp4"):
        import av

        with av.open(out, "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.height, stream.width = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
            stream.pix_fmt = "yuv420p"
            for fr in frames:
                img = Image.fromarray(fr[: stream.height, : stream.width])
                for packet in stream.encode(av.VideoFrame.from_image(img)):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    else:
        imgs = [Image.fromarray(fr).resize((fr.shape[1] * _SCALE, fr.shape[0] * _SCALE),
                                           Image.NEAREST) for fr in frames]  # fmt: skip
        imgs[0].save(out, save_all=True, append_images=imgs[1:], duration=125, loop=0)
    return Path(out)


def render_bagel(
    spec: Any, model: Any, out: str, *, prompts: list[str], processor: str,
    size: tuple[int, int], steps: int, guidance: float, seed: int,
) -> Path:  # fmt: skip
    """A PNG of one image per prompt, side by side: each prompt goes through the ``bagel``
    processor's chat markup, then ``families.bagel.generate_latents`` (Euler steps of the
    velocity field, classifier-free guidance against an empty prompt when ``guidance > 1``) and
    the model's VAE (or pixel-space stand-in) decodes. ``size``: pixels (height, width)."""
    from lmms_data import build_processor
    from lmms_models.families.bagel._sample import generate_latents

    conf = model.config
    proc = build_processor("bagel", processor, **spec.processor_options(conf))
    decode = spec.latent_decoder(model)
    if decode is None:
        raise ValueError("render: this checkpoint has no VAE to decode its latents")
    f = conf.vae_downsample * conf.latent_patch_size
    if size[0] % f or size[1] % f:
        raise ValueError(f"render: --height/--width must be multiples of {f}")
    shape = (conf.latent_channels, size[0] // conf.vae_downsample, size[1] // conf.vae_downsample)
    tiles = []
    for i, prompt in enumerate(prompts):
        lat = generate_latents(
            model, proc.generation_prompt(prompt), shape, start_of_image=proc.start_of_image,
            end_of_image=proc.end_of_image, steps=steps, guidance=guidance,
            null_prompt=proc.generation_prompt(""), seed=seed + i,
        )  # fmt: skip
        tiles.append(_to_uint8(decode(lat)).transpose(1, 2, 0))
    grid = np.concatenate(tiles, axis=1)
    pil = Image.fromarray(grid).resize((grid.shape[1] * _SCALE, grid.shape[0] * _SCALE),
                                       Image.NEAREST)  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pil.save(out)
    return Path(out)


def precompute(cfg: Any, out: str, *, rows_per_shard: int = 512) -> tuple[int, int]:
    """Encode CONFIG's dataset once with its model's frozen encoders; write Parquet shards of
    ``latents`` + ``label`` / ``text_embeds``. Returns (records, shards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmms_data import build_latent_loader
    from lmms_data._latent import npy_bytes
    from lmms_models import GeneratesLatents
    from lmms_train._data_setup import data_config
    from lmms_train._latent_data import _tokenizer, model_config_for_data
    from lmms_train._model_setup import resolve_spec

    spec = resolve_spec(cfg)
    if not isinstance(spec, GeneratesLatents):
        raise ValueError(f"precompute: {spec.name} is not a diffusion-transformer family")
    _, sources = spec.split_encoders(model_config_for_data(cfg, spec))
    encoders = {name: spec.build_encoder(name, src) for name, src in sources.items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = dict(cfg.dataset_config.extra, batch_size=1)  # every record, in order
    dcfg = data_config(cfg, spec, shuffle=False, num_epochs=1, extra=extra)
    loader = build_latent_loader(dcfg, tokenizer=_tokenizer(cfg))
    Path(out).mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    n = shards = 0

    def flush() -> None:
        nonlocal rows, shards
        if rows:
            pq.write_table(pa.Table.from_pylist(rows), str(Path(out) / f"{shards:05d}.parquet"))
            rows, shards = [], shards + 1

    with torch.no_grad():
        for batch in loader:
            x1, cond = spec.encode_batch(encoders, batch, device)
            for i in range(x1.shape[0]):
                row: dict[str, Any] = {"latents": npy_bytes(x1[i].cpu().numpy())}
                if cond.dtype == torch.int64:
                    row["label"] = int(cond[i])
                else:
                    row["text_embeds"] = npy_bytes(cond[i].cpu().numpy())
                rows.append(row)
                n += 1
                if len(rows) >= rows_per_shard:
                    flush()
    flush()
    return n, shards
