"""Diffusion-LM checkpoints in the layouts of public releases, through local folders only.

A dLLM built on a Qwen/LLaMA-style decoder is that decoder's checkpoint plus three facts in its
``config.json``: attention is bidirectional, which token id is the mask, and whether position
``i`` predicts token ``i`` or ``i + 1``. The layouts known here:

* **lmms** (what ``lmms-train`` exports for ``objective: masked_diffusion``): the family's own
  layout (``model_type: qwen3``, ...) with ``is_causal: false``, ``mask_token_id`` and
  ``lmms_diffusion_shift``. transformers loads it with the family's class; its mask builder
  honours ``is_causal: false``.
* **Dream** (Dream-v0 7B, Dream-Coder, DiffuCoder: ``model_type: "Dream"``,
  ``architectures: ["DreamModel"]``): Qwen2 parameter names unchanged (``model.layers.N...``,
  ``lm_head``), ``mask_token_id`` in the config, shifted prediction (adapted from Qwen2.5). Read as
  the ``qwen2`` family without running the release's remote code; written back by
  :func:`export_dream` (config rewritten, weights copied byte for byte).

* **LLaDA** (LLaDA-8B Base / Instruct, LLaDA-1.5: ``model_type: "llada"``,
  ``architectures: ["LLaDAModelLM"]``): a LLaMA decoder under OLMo-style names
  (``model.transformer.blocks.N.ff_proj``) and its own config keys; read as the ``llama`` family
  through the name and key map of :mod:`.llada`, unshifted, written back by
  :func:`~.llada.export_llada` (tensors renamed, bytes unchanged).

Remote code is never run: folders are read with the family's transformers classes and
``local_files_only=True``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

__all__ = [
    "DLLM_LAYOUTS",
    "DllmCheckpoint",
    "DllmLayout",
    "export_dream",
    "load_dllm",
    "read_layout",
]


@dataclass(frozen=True, slots=True)
class DllmLayout:
    """How a release's ``config.json`` maps onto an lmms family."""

    family: str  # lmms_models family whose classes load the weights
    shift: bool  # position i predicts token i+1
    architectures: tuple[str, ...] = ()  # written back on export


#: ``config.json`` ``model_type`` of public dLLM releases -> lmms layout.
DLLM_LAYOUTS: dict[str, DllmLayout] = {
    "Dream": DllmLayout(family="qwen2", shift=True, architectures=("DreamModel",)),
    "llada": DllmLayout(family="llama", shift=False, architectures=("LLaDAModelLM",)),
}


def read_layout(folder: str | Path) -> tuple[str, dict[str, Any], bool | None]:
    """``(lmms family, config dict, shift or None if the config does not say)`` of a local folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder!r} (only local folders are read)")
    conf = json.loads(path.read_text())
    model_type = conf.get("model_type", "")
    layout = DLLM_LAYOUTS.get(model_type)
    if layout is not None:
        return layout.family, conf, layout.shift
    shift = conf.get("lmms_diffusion_shift")
    return model_type, conf, None if shift is None else bool(shift)


@dataclass(kw_only=True, slots=True)
class DllmCheckpoint:
    spec: Any
    model: nn.Module
    mask_token_id: int
    shift: bool


def load_dllm(
    folder: str | Path, *, device: str = "cpu", mask_token_id: int | None = None
) -> DllmCheckpoint:
    """A dLLM from a local folder (lmms, Dream or LLaDA layout), bidirectional, in eval mode.

    The weights load through the family's transformers class (upstream attention, SDPA), then the
    text decoder's attention is made non-causal. ``mask_token_id`` overrides the config's.
    """
    import torch

    from .. import get_model_spec
    from ..objectives.masked_diffusion import make_bidirectional

    family, conf, shift = read_layout(folder)
    spec = get_model_spec(family)
    mask = mask_token_id if mask_token_id is not None else conf.get("mask_token_id")
    if mask is None:
        raise ValueError(f"{folder}: config.json has no mask_token_id; pass mask_token_id")
    release = conf.get("model_type") in DLLM_LAYOUTS  # a release's layout implies non-causal
    if not release and conf.get("is_causal", True) is not False:
        raise ValueError(
            f"{folder}: config.json does not say is_causal: false; this is a causal LM checkpoint "
            "(train it with objective: masked_diffusion first, or pass a dLLM folder)"
        )
    model = spec.build(
        pretrained=str(folder), device=device, attn_backend="sdpa", dtype=torch.float32
    )
    make_bidirectional(spec, model)
    model.eval()
    return DllmCheckpoint(spec=spec, model=model, mask_token_id=int(mask), shift=bool(shift))


def export_dream(src: str | Path, dst: str | Path, *, mask_token_id: int | None = None) -> Path:
    """Write a Qwen2-family dLLM folder (lmms layout, shifted prediction) in Dream's layout.

    ``config.json`` gets ``model_type: "Dream"``, ``architectures: ["DreamModel"]`` and the mask
    token id; weight files and tokenizer files are copied unchanged (the parameter names are
    Dream's already). Dream's modeling code (``auto_map``) is not written: copy it from the release
    to use Dream's own generation code; lmms reads the folder without it.
    """
    src, dst = Path(src), Path(dst)
    family, conf, shift = read_layout(src)
    if family not in ("qwen2", "qwen2_5"):
        raise ValueError(f"Dream's layout is a Qwen2 decoder; {src} holds {family!r}")
    if shift is False:
        raise ValueError(
            f"{src} predicts token i at position i (lmms_diffusion_shift: false); Dream reads "
            "position i-1: train with objective_args.shift: true"
        )
    mask = mask_token_id if mask_token_id is not None else conf.get("mask_token_id")
    if mask is None:
        raise ValueError(f"{src}: config.json has no mask_token_id; pass mask_token_id")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    out = {k: v for k, v in conf.items() if not k.startswith("lmms_") and k != "auto_map"}
    out.update(
        model_type="Dream",
        architectures=list(DLLM_LAYOUTS["Dream"].architectures),
        mask_token_id=int(mask),
        is_causal=False,
    )
    (dst / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return dst
