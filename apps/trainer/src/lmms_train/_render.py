"""Writing the renders of trained generative checkpoints, and precomputing latents.

See `lmms_train._diffusion_cli` for the commands. The family draws (`lmms_models.Renders`:
uint8 RGB images or video frames); this module writes the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["precompute", "write_media"]

_SCALE = 4  # upscaling of tiny renders (nearest) so they can be looked at


def _upscaled(img: np.ndarray) -> Image.Image:
    return Image.fromarray(img).resize((img.shape[1] * _SCALE, img.shape[0] * _SCALE),
                                       Image.NEAREST)  # fmt: skip


def write_media(media: np.ndarray, out: str) -> Path:
    """Write a family's render (uint8 RGB, :class:`lmms_models.Renders`): an image
    ``[H, W, 3]`` as PNG, a video ``[F, H, W, 3]`` as GIF or (``.mp4``) MP4; images and GIF
    frames upscaled ``_SCALE`` times (nearest)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if media.ndim == 3:
        _upscaled(media).save(out)
    elif out.endswith(".mp4"):
        import av

        with av.open(out, "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.height, stream.width = media.shape[1] // 2 * 2, media.shape[2] // 2 * 2
            stream.pix_fmt = "yuv420p"
            for fr in media:
                img = Image.fromarray(fr[: stream.height, : stream.width])
                for packet in stream.encode(av.VideoFrame.from_image(img)):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    else:
        imgs = [_upscaled(fr) for fr in media]
        imgs[0].save(out, save_all=True, append_images=imgs[1:], duration=125, loop=0)
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
    from lmms_train._latent_data import model_config_for_data, tokenizer_for_data
    from lmms_train._model_setup import resolve_spec

    spec = resolve_spec(cfg)
    if not isinstance(spec, GeneratesLatents):
        raise ValueError(f"precompute: {spec.name} is not a diffusion-transformer family")
    _, sources = spec.split_encoders(model_config_for_data(cfg, spec))
    encoders = {name: spec.build_encoder(name, src) for name, src in sources.items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = dict(cfg.dataset_config.extra, batch_size=1)  # every record, in order
    dcfg = data_config(cfg, spec, shuffle=False, num_epochs=1, extra=extra)
    loader = build_latent_loader(dcfg, tokenizer=tokenizer_for_data(cfg))
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
