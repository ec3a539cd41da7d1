"""Split a model's parameters into Muon and AdamW groups, without model-specific names."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

__all__ = ["DEFAULT_ADAMW_PATTERNS", "build_muon_param_groups"]

# Regexes (re.search on the full parameter name) that force AdamW. Structural detection below
# already catches nn.Embedding and HF's get_input/output_embeddings(); these are a fallback for
# untied output heads that are plain nn.Linear modules. Override with ``adamw_patterns=()``.
DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (r"(^|\.)lm_head\.", r"(^|\.)(output|score|classifier)\.")


def _module_params(modules: Iterable[nn.Module | None]) -> set[int]:
    return {id(p) for m in modules if m is not None for p in m.parameters()}


def build_muon_param_groups(
    model: nn.Module,
    *,
    lr: float = 0.02,
    weight_decay: float = 0.0,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.0,
    decay_1d: bool = False,
    adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS,
    adamw_modules: Iterable[nn.Module] = (),
    muon_for_conv: bool = False,
) -> list[dict[str, Any]]:
    """Param groups for :class:`Muon`: hidden matrices → Muon; everything else → AdamW.

    AdamW takes: parameters of ``nn.Embedding`` modules, of ``model.get_input_embeddings()`` /
    ``get_output_embeddings()`` when the model has them (HF convention, so tied and untied heads
    both count), names matching ``adamw_patterns``, parameters of ``adamw_modules``, and every
    parameter that is not 2-D (norms, biases, convolution kernels unless ``muon_for_conv``, in
    which case ≥3-D kernels are flattened to ``[out, -1]`` for Muon).

    Returns up to three groups: ``muon`` (``lr``, ``weight_decay``), ``adamw`` (matrices and
    kernels; ``adamw_lr`` defaulting to ``lr``, ``adamw_weight_decay``) and ``adamw_no_decay``
    (1-D parameters; weight decay 0 unless ``decay_1d``). Each group has a ``name`` key.
    Frozen parameters (``requires_grad=False``) are left out.
    """
    forced = _module_params(m for m in model.modules() if isinstance(m, nn.Embedding))
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        if callable(fn):
            with contextlib.suppress(NotImplementedError, AttributeError):
                forced |= _module_params([fn()])
    forced |= _module_params(adamw_modules)
    patterns = [re.compile(p) for p in adamw_patterns]
    muon, adamw, no_decay = [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        special = id(p) in forced or any(r.search(name) for r in patterns)
        if (p.ndim == 2 and not special) or (p.ndim > 2 and muon_for_conv and not special):
            muon.append(p)
        elif p.ndim >= 2:
            adamw.append(p)
        else:
            no_decay.append(p)
    adamw_common = dict(
        use_muon=False, lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
        eps=adamw_eps,
    )  # fmt: skip
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append(
            dict(params=muon, name="muon", use_muon=True, lr=lr, weight_decay=weight_decay)
        )
    if adamw:
        groups.append(
            dict(params=adamw, name="adamw", weight_decay=adamw_weight_decay, **adamw_common)
        )
    if no_decay:
        wd = adamw_weight_decay if decay_1d else 0.0
        groups.append(dict(params=no_decay, name="adamw_no_decay", weight_decay=wd, **adamw_common))
    return groups
