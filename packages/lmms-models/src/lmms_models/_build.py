"""One ``build`` for the families that make their module another way than ``ModelSpec.build``
(a local class, ``fla.models``' or diffusers' classes, another checkpoint layout): the argument
check and the attention switch live here once, the family overrides :meth:`BuildSpec.build_module`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ._spec import ModelSpec

__all__ = ["BuildSpec", "build_hf_style"]


class BuildSpec(ModelSpec):
    """A :class:`ModelSpec` whose :meth:`build` goes through :meth:`build_module` (default:
    ``transformers.<model_class>``, as :meth:`ModelSpec.build`)."""

    def build(
        self,
        *,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "auto",
        vision_attn_backend: str | None = None,
        **_: Any,
    ) -> nn.Module:
        """As :meth:`ModelSpec.build`: the module of :meth:`build_module`, then
        :meth:`set_attention` with ``attn_backend`` / ``vision_attn_backend``."""
        if (config is None) == (pretrained is None):
            raise ValueError("give exactly one of config= or pretrained=")
        source = pretrained if config is None else config
        model = self.build_module(source, torch.device(device), dtype)  # type: ignore[arg-type]
        self.set_attention(model, backend=attn_backend, vision_backend=vision_attn_backend)
        return model

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """The module from ``source``, a config dict or a local folder (on ``meta`` only the
        folder's config is read), on ``device`` in ``dtype``."""
        import transformers

        model_cls = getattr(transformers, self.model_class)
        config_cls = getattr(transformers, self.config_class)
        return build_hf_style(self.make_config, model_cls, config_cls, source, device, dtype)


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
