"""Omni checkpoints: the thinker out of a released full-model folder.

The public Qwen2.5-Omni and Qwen3-Omni folders hold the whole model (``config.json`` with
``thinker_config``, ``talker_config`` and ``token2wav_config`` / ``code2wav_config``; weights
under ``thinker.``, ``talker.``, ``token2wav.`` / ``code2wav.``). lmms trains the thinker only:
such a folder loads through the thinker class's own ``from_pretrained`` (transformers reads the
thinker's config and weights out of it, with its renames and fusions of this version: e.g.
Qwen3-Omni's per-expert tensors into the 3-D experts), the speech part is left out with one
line saying so, and anything else missing or left over is an error.

The export (``export_hf``) writes the thinker as ``save_pretrained`` of the thinker class writes
it (``config.json`` of ``model_type`` ``qwen2_5_omni_thinker`` / ``qwen3_omni_moe_thinker``).
When the run started from a full Omni folder, :func:`write_full_omni` then turns that folder
back into the release's layout: the trained thinker under ``thinker.``, the source's talker and
speech decoder tensors copied unchanged, the source's ``config.json`` with the trained
thinker's config, so ``<Omni>ForConditionalGeneration.from_pretrained`` (speech included) and
lmms read it as they read the release.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

__all__ = ["SPEECH_PREFIXES", "is_full_omni", "load_thinker", "speech_keys", "write_full_omni"]

#: Weight prefixes of the parts of a full Omni checkpoint that lmms does not train.
SPEECH_PREFIXES = ("talker.", "token2wav.", "code2wav.")


def is_full_omni(folder: str | Path) -> bool:
    """Whether ``folder`` holds a full Omni model (its config has a ``thinker_config``)."""
    conf = Path(folder) / "config.json"
    return conf.is_file() and "thinker_config" in json.loads(conf.read_text())


def _weight_names(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    return names


def speech_keys(folder: str | Path) -> dict[str, int]:
    """Tensors per speech prefix (``talker.``, ...) in ``folder``'s weights (present ones only)."""
    names = _weight_names(Path(folder))
    counts = {p: sum(n.startswith(p) for n in names) for p in SPEECH_PREFIXES}
    return {p: n for p, n in counts.items() if n}


def load_thinker(
    model_cls: type, folder: str | Path, *, dtype: torch.dtype | str = "auto"
) -> nn.Module:
    """``model_cls`` (the thinker class) from ``folder`` (full Omni or thinker only), on the CPU.

    transformers' per-key load report and progress bar are kept quiet (5.17 lists every talker tensor as
    unexpected); instead a missing thinker weight raises, an unexpected one outside the speech
    prefixes raises, and a full folder gets one line naming what was left out."""
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    thinker_type = model_cls.config_class.model_type  # e.g. qwen2_5_omni_thinker
    accepted = (thinker_type, thinker_type.removesuffix("_thinker"))
    conf = folder / "config.json"
    found = json.loads(conf.read_text()).get("model_type") if conf.is_file() else None
    if found not in accepted:  # before from_pretrained builds a default-sized model from it
        raise ValueError(
            f"{folder}: config.json has model_type {found!r}; a {model_cls.__name__} loads "
            f"from a folder of model_type {accepted[1]!r} (full Omni) or {accepted[0]!r}"
        )
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = model_cls.from_pretrained(
            str(folder), dtype=dtype, attn_implementation="sdpa", local_files_only=True,
            output_loading_info=True,
        )  # fmt: skip
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    missing = list(info.get("missing_keys") or [])
    extra = [k for k in info.get("unexpected_keys") or [] if not k.startswith(SPEECH_PREFIXES)]
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or extra or mismatched:
        raise ValueError(
            f"{folder}: not a {model_cls.__name__} checkpoint: {len(missing)} weights missing "
            f"(e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]}), "
            f"{len(mismatched)} of another shape"
        )
    if is_full_omni(folder):
        left = speech_keys(folder)
        what = ", ".join(f"{n} {p}* tensors" for p, n in left.items()) or "no speech weights"
        print(
            f"[lmms-models] {folder} is a full Omni checkpoint: training its thinker "
            f"({model_cls.__name__}), leaving out {what} (not trained; the trainer's export "
            "puts them back unchanged)",
            file=sys.stderr,
            flush=True,
        )
    return model


def write_full_omni(out: str | Path, source: str | Path, *, shard_bytes: int = 5 << 30) -> int:
    """Rewrite the thinker export in ``out`` as the full Omni folder of ``source`` (see the
    module docstring); returns the number of speech tensors copied. Shard by shard: the thinker
    shards are renamed (``thinker.`` prefix where transformers' thinker save left it out), the
    source's non-thinker tensors copied in their dtype; a new index; the thinker-only
    ``config.json`` / ``generation_config.json`` replaced by the source's (its ``thinker_config``
    by the trained thinker's); the source's other files the export lacks copied (the speaker
    table ``spk_dict.pt``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out, source = Path(out), Path(source)
    thinker_conf = json.loads((out / "config.json").read_text())
    full_conf = json.loads((source / "config.json").read_text())
    old = sorted(out.glob("*.safetensors"))
    parts: list[dict[str, torch.Tensor]] = []
    for file in old:  # the trained thinker, in the release's names
        with safe_open(str(file), "pt") as f:
            parts.append({(k if k.startswith("thinker.") else f"thinker.{k}"): f.get_tensor(k)
                          for k in f.keys()})  # fmt: skip  # noqa: SIM118 (safe_open)
    speech: dict[str, torch.Tensor] = {}
    copied = size = 0
    for file in sorted(source.glob("*.safetensors")):  # everything else, unchanged
        with safe_open(str(file), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if not k.startswith("thinker."):
                    speech[k] = f.get_tensor(k)
                    copied, size = copied + 1, size + speech[k].nbytes
                    if size >= shard_bytes:
                        parts.append(speech)
                        speech, size = {}, 0
    if speech:
        parts.append(speech)
    for file in old:
        file.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in part.items()}, str(out / name),
                  metadata={"format": "pt"})  # fmt: skip
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    thinker_conf.pop("architectures", None)
    full_conf["thinker_config"] = thinker_conf
    (out / "config.json").write_text(json.dumps(full_conf, indent=2, sort_keys=True) + "\n")
    if (source / "generation_config.json").is_file():
        (out / "generation_config.json").write_text((source / "generation_config.json").read_text())
    for extra in sorted(source.iterdir()):  # what the full model reads beside its weights
        # (Qwen2.5-Omni's speaker table spk_dict.pt); the run's processor files stay
        if extra.is_file() and extra.suffix != ".safetensors" and not (out / extra.name).exists():
            shutil.copyfile(extra, out / extra.name)
    return copied
