"""``generate_synthetic(kind, ...)``: the demo record generators of lmms-data by kind, one table
(what ``dataset_config.generate_synthetic.kind`` names; a model family's default kind is its
``synthetic_kind``). A family's own demo data registers its kind from its module under
``lmms_data.processors`` (:func:`register_synthetic_kind`)."""

from __future__ import annotations

from collections.abc import Callable

from lmms_data._registry import Registry
from lmms_data._synthetic import generate_synthetic_text, generate_synthetic_vl
from lmms_data._synthetic_audio import generate_synthetic_audio, generate_synthetic_omni
from lmms_data._synthetic_diffusion import generate_synthetic_clips, generate_synthetic_shapes
from lmms_data._synthetic_preference import generate_synthetic_preference

__all__ = ["SYNTHETIC_KINDS", "generate_synthetic", "register_synthetic_kind"]

Generator = Callable[..., object]
#: ``kind -> generator(out_dir, n, *, format, seed, image_size)`` (each takes what it uses);
#: lmms-data's one registry mechanism (``lmms_data._registry.Registry``)
SYNTHETIC_KINDS: Registry[Generator] = Registry("synthetic kind")


def register_synthetic_kind(name: str) -> Callable[[Generator], Generator]:
    """Decorator: add ``generator(out_dir, n, *, format, seed, image_size)`` as kind ``name``."""
    return SYNTHETIC_KINDS.register(name)


_BUILT_IN: dict[str, Generator] = {
    "text": lambda out, n, *, format, seed, image_size: generate_synthetic_text(
        out, n, format=format, seed=seed
    ),
    "audio": lambda out, n, *, format, seed, image_size: generate_synthetic_audio(
        out, n, format=format, seed=seed
    ),
    "vl": lambda out, n, *, format, seed, image_size: generate_synthetic_vl(
        out, n, format=format, seed=seed, image_size=image_size
    ),
    "omni": lambda out, n, *, format, seed, image_size: generate_synthetic_omni(
        out, n, format=format, seed=seed, image_size=image_size
    ),
    "preference": lambda out, n, *, format, seed, image_size: generate_synthetic_preference(
        out, n, seed=seed, image_size=image_size
    ),
    # latent demos of the diffusion transformers: class-labelled shapes, captioned clips
    "shapes": lambda out, n, *, format, seed, image_size: generate_synthetic_shapes(
        out, n, seed=seed, image_size=image_size
    ),
    "clips": lambda out, n, *, format, seed, image_size: generate_synthetic_clips(
        out, n, seed=seed, size=image_size
    ),
}
for _name, _generator in _BUILT_IN.items():
    register_synthetic_kind(_name)(_generator)


def generate_synthetic(
    kind: str, out_dir: str, n: int, *, format: str = "parquet", seed: int = 0,
    image_size: int = 64,
) -> None:  # fmt: skip
    """Write ``n`` synthetic records of ``kind`` (:data:`SYNTHETIC_KINDS`) under ``out_dir``."""
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; known: {SYNTHETIC_KINDS.names()}")
    SYNTHETIC_KINDS.get(kind)(out_dir, n, format=format, seed=seed, image_size=image_size)
