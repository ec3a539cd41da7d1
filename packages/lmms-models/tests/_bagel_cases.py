"""Shared BAGEL test material: a tiny model with non-zero heads, generated interleaved samples of
every kind, and loss/gradient helpers (used by test_bagel.py and its spawned FSDP2 workers)."""

from __future__ import annotations

from typing import Any

import torch

from lmms_parallel.testing import full_grads

SOI, EOI = 1, 2  # start / end of image markers inside the tiny vocabulary


def tiny_model() -> tuple[Any, Any]:
    from lmms_models import get_model_spec

    spec = get_model_spec("bagel")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(), attn_backend="sdpa")
    with torch.no_grad():  # llm2vae starts at zero: random weights make every gradient real
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return spec, model


def samples(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """One sample of each kind (understanding, generation, editing, text, a length-1 text)."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int, loss: bool = True) -> dict[str, Any]:
        return {
            "type": "text",
            "ids": torch.randint(5, 1000, (n,), generator=g).tolist(),
            "loss": loss,
        }

    def img(h: int, w: int) -> dict[str, Any]:
        return {"type": "vit", "pixels": torch.randn(3, h, w, generator=g)}

    def lat(kind: str, h: int, w: int) -> dict[str, Any]:
        return {"type": kind, "latents": torch.randn(4, h, w, generator=g)}

    return {
        "und": [text(4, False), img(8, 12), text(5)],
        "und2": [img(12, 8), text(3), img(4, 4), text(2)],
        "gen": [text(5, False), lat("vae_gen", 4, 6)],
        "edit": [
            text(2, False),
            lat("vae_cond", 4, 4),
            text(3, False),
            lat("vae_gen", 4, 4),
            text(2),
        ],
        "text": [text(7)],
        "one": [text(1)],
    }


PACKS = {
    "understanding": ["und", "und2", "one"],
    "generation": ["gen", "text", "one"],
    "editing": ["edit", "one"],
    "mixed": ["und", "gen", "edit", "text", "und2", "one"],
}


def pack(names: list[str], backend: str = "sdpa", seed: int = 0) -> dict[str, Any]:
    from lmms_models import get_model_spec
    from lmms_models.families.bagel import pack_samples

    cfg = get_model_spec("bagel").make_config(get_model_spec("bagel").tiny_config())
    pool = samples(seed)
    seeds = [100 + sorted(pool).index(n) for n in names]  # a sample's seed is its own
    return pack_samples([pool[n] for n in names], cfg, start_of_image=SOI, end_of_image=EOI,
                        seeds=seeds, backend=backend)  # fmt: skip


def loss_grads(spec: Any, model: Any, batch: dict[str, Any], total: float = 1.0,
               seed: int = 3) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:  # fmt: skip
    """(loss_sum, {ce, fm sums}, gradients of loss_sum / total by parameter name)."""
    from lmms_models.objectives import ObjectiveContext, get_objective

    obj = get_objective("ce_flow_matching", ce_weight=1.0, fm_weight=2.0)
    model.zero_grad(set_to_none=True)
    out = obj.loss(spec, model, batch, ObjectiveContext(seed=seed))
    (out.loss_sum / total).backward()
    grads = full_grads(model, zeros_for_missing=True)
    sums = {k: float(v[0]) for k, v in out.metrics.items() if k in ("ce", "fm")}
    return float(out.loss_sum.detach()), sums, grads


def worst(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Largest gradient difference relative to each tensor's largest reference entry (floored at
    1e-6: a key bias's gradient is zero in exact arithmetic, ~1e-11 of rounding in floats)."""
    out = 0.0
    for n, r in ref.items():
        out = max(out, float((got[n] - r).abs().max()) / max(float(r.abs().max()), 1e-6))
    return out
