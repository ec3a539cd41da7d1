"""Attention wiring: which attention function each tower uses, and where the text pack's
boundaries enter the model.

Two upstream traps shape this module (see /work/shared/ENVIRONMENT.md):

* Qwen-VL vision towers hand ``cu_seq_lens_q/k`` (their per-image / per-window boundaries) to the
  attention function only when the implementation's *name* contains ``"flash"``; otherwise they
  loop over windows in Python. So the lmms names contain ``"flash"``.
* A name containing ``"flash"`` given at construction is looked up as a hub kernel, so models are
  built with ``"sdpa"`` and the registered names are set on the configs afterwards.

The text pack's boundaries are *not* passed through the model call: on some transformers versions
keyword arguments of the top-level call also reach the vision tower's attention, where they would
clash with the tower's own boundaries. A forward pre-hook on the text decoder adds them to that
module's keyword arguments only (:func:`text_attention_kwargs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["UPSTREAM_BACKENDS", "set_attention", "text_attention_kwargs"]

#: Backends that leave the upstream attention in place (no lmms kernel; reference paths).
UPSTREAM_BACKENDS = ("eager", "sdpa")


def _configs_of(module: nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
            for sub in ("text_config", "vision_config"):
                subcfg = getattr(cfg, sub, None)
                if subcfg is not None and hasattr(subcfg, "_attn_implementation"):
                    seen.setdefault(id(subcfg), subcfg)
    return list(seen.values())


def set_attention(
    model: nn.Module,
    vision_tower: nn.Module | None,
    *,
    backend: str = "auto",
    wrapper: Callable[..., torch.Tensor] | None = None,
    vision_backend: str | None = None,
) -> dict[str, str]:
    """Point every attention module of ``model`` at ``backend``; return ``{"text", "vision"}`` names.

    ``backend`` is ``"eager"``/``"sdpa"`` (upstream attention, used by reference runs) or an
    ``lmms_kernels`` varlen backend: ``"auto"``, ``"fa4"``, ``"fa"``, ``"torch"``, ``"flex"``, or
    ``"varlen_sdpa"`` (lmms_kernels' SDPA-per-segment reference backend, which it calls ``"sdpa"``;
    renamed here because ``"sdpa"`` means upstream attention).
    ``wrapper`` (e.g. lmms-parallel's Ulysses attention) applies to the text decoder only.
    ``vision_backend`` (default: ``backend``) gives the vision tower its own backend (e.g.
    ``"torch"``: aten's flash attention takes the ViT's head dim 80 without FA4's padding).
    """
    vision_cfgs = {id(c) for c in _configs_of(vision_tower)} if vision_tower is not None else set()
    if vision_tower is not None and hasattr(model, "config"):
        vc = getattr(model.config, "vision_config", None)
        if vc is not None:
            vision_cfgs.add(id(vc))
    vision_backend = backend if vision_backend is None else vision_backend
    if backend in UPSTREAM_BACKENDS:
        if wrapper is not None:
            raise ValueError(f"an attention wrapper needs an lmms varlen backend, not {backend!r}")
        text_name = backend
    else:
        text_name = _register("text", backend, "_sp" if wrapper is not None else "", wrapper)
    if vision_backend in UPSTREAM_BACKENDS:
        vision_name = vision_backend
    else:
        vision_name = _register("vision", vision_backend)
    for cfg in _configs_of(model):
        cfg._attn_implementation = vision_name if id(cfg) in vision_cfgs else text_name
    return {"text": text_name, "vision": vision_name}


def _register(
    tower: str, backend: str, suffix: str = "", wrapper: Callable[..., torch.Tensor] | None = None
) -> str:
    import lmms_kernels

    kernel_backend = "sdpa" if backend == "varlen_sdpa" else backend
    return lmms_kernels.register_varlen_attention(
        f"lmms_flash_{tower}_{backend}{suffix}", backend=kernel_backend, wrapper=wrapper
    )


@contextmanager
def forward_pre_hook(module: nn.Module, hook: Any) -> Iterator[None]:
    """While active, ``hook(module, args, kwargs) -> (args, kwargs)`` runs before every call of
    ``module`` (a keyword-aware forward pre-hook, removed on exit)."""
    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def text_attention_kwargs(module: nn.Module, **kwargs: Any) -> Iterator[None]:
    """While active, every call of ``module`` (the text decoder) also receives ``kwargs``.

    Used for transformers' flash keyword arguments (``cu_seq_lens_q``, ``max_length_q``, ...) so they
    reach the decoder layers' attention and nothing else. Activation checkpointing is unaffected:
    layers capture their keyword arguments at call time and recompute with the same ones.
    """

    def hook(_mod: nn.Module, args: tuple, kw: dict) -> tuple[tuple, dict]:
        return args, {**kw, **kwargs}

    with forward_pre_hook(module, hook):
        yield
