"""The module of a HF-style class from a config dict or a local folder: what
``ModelSpec.build_module`` does for ``transformers.<model_class>``, and what families with
another class (aero's, fla's) call with theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["build_hf_style"]


def build_hf_style(
    make_config: Callable[[dict[str, Any]], Any],
    model_cls: Any,
    config_cls: Any,
    source: dict[str, Any] | str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    sdpa_configs: Sequence[str] | None = ("text_config", "vision_config"),
) -> nn.Module:
    """An HF-style ``model_cls`` from ``source``: a config dict (through ``make_config``) or a folder
    (its weights through ``from_pretrained``, no hub access; on ``meta`` only ``config_cls`` reads
    its config). ``sdpa_configs``: the config and these sub-configs start on upstream SDPA (what
    ``set_attention`` switches); ``None`` for classes without an attention choice."""
    attn = {} if sdpa_configs is None else {"attn_implementation": "sdpa"}
    if isinstance(source, str) and device.type != "meta":
        model = model_cls.from_pretrained(source, dtype=dtype, local_files_only=True, **attn)
        return model.to(device)
    if isinstance(source, str):
        hf_config = config_cls.from_pretrained(source, local_files_only=True)
    else:
        hf_config = make_config(source)
    for cfg in (hf_config, *(getattr(hf_config, s, None) for s in sdpa_configs or ())):
        if sdpa_configs is not None and cfg is not None:
            cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = model_cls(hf_config)
    return model.to(dtype)
