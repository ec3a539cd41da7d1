"""Whether the tokenizer/processor fits the model, checked before the model is built.

A processor cuts images into patches of its own `patch_size`, merges `merge_size`² of them per
token and stacks `temporal_patch_size` frames; the model's vision tower reads patches of its
`vision_config.patch_size`, `spatial_merge_size` and `temporal_patch_size`. When they differ the
first step fails deep in the vision tower (`shape '[3528, -1]' is invalid for input of size
9216`); here it is one line naming both values. A processor family other than the model's (a
text processor on a vision-language model) is refused the same way. Generic: it reads Hugging
Face attribute names, no family is named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmms_train._errors import ConfigError
from lmms_train.config import TrainConfig

__all__ = ["processor_problems"]

# processor attribute (image_processor of processor_config.json / preprocessor_config.json)
# -> the model's vision_config attribute it must equal
_PAIRS = (
    ("patch_size", "patch_size"),
    ("merge_size", "spatial_merge_size"),
    ("temporal_patch_size", "temporal_patch_size"),
)


def _image_processor(folder: Path) -> dict[str, Any]:
    """The image processor's settings saved in a processor folder (empty if none)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data.get("image_processor"), dict):
            return data["image_processor"]
        if "patch_size" in data:
            return data
    return {}


def _vision_config(cfg: TrainConfig, spec: Any, token_ids: dict[str, Any] | None) -> dict:
    m = cfg.model_config
    if m.load_from_pretrained_path is not None:
        try:
            conf = json.loads((Path(m.load_from_pretrained_path) / "config.json").read_text())
        except (OSError, ValueError):
            return {}
    else:
        from lmms_train._model_setup import model_config_dict

        conf = spec.make_config(model_config_dict(cfg, spec, token_ids)).to_dict()
    vision = conf.get("vision_config")
    return vision if isinstance(vision, dict) else {}


def processor_problems(
    cfg: TrainConfig, spec: Any, token_ids: dict[str, Any] | None = None
) -> list[str]:
    """Each way the processor does not fit the model, one line each (empty: it fits)."""
    from lmms_data import PROCESSOR_REGISTRY
    from lmms_train._data_setup import _processor_path

    problems = []
    given = cfg.dataset_config.processor_family
    if given and spec.media_keys and spec.processor_family:
        names = PROCESSOR_REGISTRY.names()
        if (
            given in names
            and spec.processor_family in names
            and (PROCESSOR_REGISTRY.get(given) is not PROCESSOR_REGISTRY.get(spec.processor_family))
        ):
            problems.append(
                f"dataset_config.processor_family: {given!r} does not fit the {spec.name} model "
                f"(its media need the {spec.processor_family!r} processor): remove the key to use "
                "the model's own"
            )
    folder = _processor_path(cfg)
    if not folder or not spec.media_keys or not Path(folder).is_dir():
        return problems
    image = _image_processor(Path(folder))
    vision = _vision_config(cfg, spec, token_ids) if image else {}
    pretrained = cfg.model_config.load_from_pretrained_path
    for ours, theirs in _PAIRS:
        a, b = image.get(ours), vision.get(theirs)
        if isinstance(a, int) and isinstance(b, int) and a != b:
            fix = (
                f"use the processor saved with the model {pretrained}"
                if pretrained
                else f"set model_config.load_from_config.config.vision_config.{theirs}: {a}"
            )
            problems.append(
                f"the processor {folder} does not fit the model: its image_processor.{ours} is "
                f"{a} but the model's vision_config.{theirs} is {b} ({fix})"
            )
    return problems


def check_processor_fits(
    cfg: TrainConfig, spec: Any, token_ids: dict[str, Any] | None = None
) -> None:
    problems = processor_problems(cfg, spec, token_ids)
    if problems:
        raise ConfigError(problems)
