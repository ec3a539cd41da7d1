"""Spawned workers for test_diffusion_parallel.py: Ulysses SP 2 == SP 1 (wan) and FSDP2 on 2
ranks == 1 process (sit, wan), losses and gradients, on CPU with gloo. One spawn runs all."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lmms_parallel.testing import full_grads, run_cases


def _batch(name: str, n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    if name == "sit":
        return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g),
                "class_labels": torch.arange(n) % 5, "noise_seed": torch.arange(n) + 100,
                "num_loss_tokens": n}  # fmt: skip
    # latent grid 3 x 4 x 6 -> 3 * 2 * 3 = 18 tokens: SP 2 splits inside a frame's rows
    return {"latents": torch.randn(n, 4, 3, 4, 6, generator=g),
            "text_embeds": torch.randn(n, 5, 16, generator=g),
            "noise_seed": torch.arange(n) + 100, "num_loss_tokens": n}  # fmt: skip


def _part(batch: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    out = {k: v[lo:hi] for k, v in batch.items() if torch.is_tensor(v)}
    out["num_loss_tokens"] = hi - lo
    return out


def _model(name: str):
    from lmms_models import get_model_spec

    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config())
    with torch.no_grad():  # SiT zero-initialises its output: random weights make grads real
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return spec, model


def _objective(name: str):
    from lmms_models.objectives import get_objective

    opts = {"cfg_dropout": 0.3}
    if name == "wan":
        opts.update(convention="rectified_flow", shift=3.0, time_sampling="logit_normal")
    return get_objective("flow_matching", **opts)


def _loss_grads(spec, model, obj, batch, sp_group=None) -> tuple[float, dict[str, torch.Tensor]]:
    from lmms_models.objectives import ObjectiveContext

    model.zero_grad(set_to_none=True)
    out = obj.loss(spec, model, batch, ObjectiveContext(seed=4, sp_group=sp_group))
    (out.loss_sum / 4.0).backward()  # global count: 4 samples
    grads = full_grads(model, zeros_for_missing=True)
    return float(out.loss_sum.detach()), grads


def _compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for n, r in ref.items():
        scale = float(r.abs().max()) + 1e-8
        worst = max(worst, float((got[n] - r).abs().max()) / scale)
    return worst


def _sp_case(name: str, group) -> dict[str, Any]:
    spec, model = _model(name)
    obj = _objective(name)
    batch = _batch(name, 4)
    ref_loss, ref = _loss_grads(spec, model, obj, batch)
    handle = spec.install_sp(model, group)
    loss, grads = _loss_grads(spec, model, obj, batch, sp_group=group)
    for g in grads.values():  # FSDP sums gradients over the dp_shard x sp mesh
        dist.all_reduce(g, group=group)
    handle.remove()
    after, _ = _loss_grads(spec, model, obj, batch)
    return {"loss": loss, "loss_sp1": ref_loss, "worst": _compare(ref, grads),
            "restored": after == ref_loss}  # fmt: skip


def _fsdp_case(name: str, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lmms_parallel import apply_fsdp

    spec, model = _model(name)
    obj = _objective(name)
    batch = _batch(name, 4)
    ref_loss, ref = _loss_grads(spec, model, obj, batch)
    mesh = init_device_mesh("cpu", (2,))
    apply_fsdp(model, mesh, blocks=spec.decoder_blocks(model), param_dtype=None)
    loss, grads = _loss_grads(spec, model, obj, _part(batch, 2 * rank, 2 * rank + 2))
    total = torch.tensor(loss)
    dist.all_reduce(total)
    return {"loss": float(total), "loss_1proc": ref_loss, "worst": _compare(ref, grads)}


def _encoder_case(rank: int) -> dict[str, Any]:
    """``place_encoders``: umT5 states with the text encoder FSDP2-sharded over 2 ranks, and with
    its blocks offloaded, equal the replicated encoder's (each rank encodes its own prompts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lmms_models import get_encoder, place_encoders

    spec = _spec("wan")
    conf = spec.tiny_config(text_encoder=dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32,
                            num_layers=2, num_heads=2, relative_attention_num_buckets=8))  # fmt: skip
    g = torch.Generator().manual_seed(11 + rank)  # different prompts per rank
    batch = {"input_ids": torch.randint(2, 64, (2, 6), generator=g),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
             "latents": torch.zeros(2, 4, 1, 2, 2)}  # fmt: skip
    out: dict[str, Any] = {}
    texts = {}
    for mode in ("replicate", "shard", "offload"):
        model = spec.build(config=conf)
        place_encoders(model, mode, blocks=spec.encoder_blocks, device="cpu",
                       mesh=init_device_mesh("cpu", (2,)) if mode == "shard" else None)  # fmt: skip
        texts[mode] = spec.encode_batch(
            {"text_encoder": get_encoder(model, "text_encoder", torch.device("cpu"))}, batch, "cpu"
        )[1]
        enc = get_encoder(model, "text_encoder", torch.device("cpu"))
        params = list(enc.encoder.block[0].parameters())
        out[f"{mode}/dtensor"] = all(isinstance(p, DTensor) for p in params)
        out[f"{mode}/grads"] = any(p.requires_grad for p in enc.parameters())
    for mode in ("shard", "offload"):
        out[f"{mode}/worst"] = float((texts[mode] - texts["replicate"]).abs().max())
    out["nonzero"] = float(texts["replicate"].abs().max()) > 0
    return out


def _spec(name: str):
    from lmms_models import get_model_spec

    return get_model_spec(name)


def run(rank: int, world: int) -> dict[str, Any]:
    """Every case on this rank (lmms_parallel.testing.spawn_ranks runs it)."""
    return run_cases([("sp/wan", lambda: _sp_case("wan", dist.group.WORLD)),
                      ("fsdp/sit", lambda: _fsdp_case("sit", rank)),
                      ("fsdp/wan", lambda: _fsdp_case("wan", rank)),
                      ("encoders/wan", lambda: _encoder_case(rank))])  # fmt: skip
