"""Worker of test_sp_plans.py: a toy transformer over ``[B, N, C]`` tokens, laid out as diffusers'
attention (``norm_q``/``norm_k`` over all heads, ``to_v``, ``to_out[0]``, ``heads``), under the
token styles of lmms_parallel.apply_sp on 2 gloo ranks against one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lmms_parallel as lp
from lmms_parallel.testing import run_cases

C, HEADS = 16, 4
PLAN = {
    "blocks.0": "sp_split_tokens",
    "blocks.*.attn.norm_q": "sp_tokens_to_heads",
    "blocks.*.attn.norm_k": "sp_tokens_to_heads",
    "blocks.*.attn.to_v": "sp_tokens_to_heads",
    "blocks.*.attn.to_out.0": "sp_heads_to_tokens",
    "blocks.*.attn": "sp_local_heads",
    "norm_out": "sp_gather_tokens",
    "proj_out": "sp_replicated_grad",
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.to_q, self.to_k, self.to_v = (nn.Linear(C, C) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(C), nn.RMSNorm(C)  # over all heads
        self.to_out = nn.ModuleList([nn.Linear(C, C)])

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:  # x [B, N, C]
        q, k = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(x))
        v = self.to_v(x)
        q, k, v = (t.unflatten(2, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        q = q * rope[: q.shape[2]][None, None]  # [1, 1, N, 1]: positions of the whole sequence
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.to_out[0](out)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(C), Attention(), nn.Linear(C, C)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x) + cond[:, None], rope)
        return x + torch.tanh(self.mlp(x))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cond = nn.Linear(3, C), nn.Linear(1, C)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm_out, self.proj_out = nn.LayerNorm(C, elementwise_affine=False), nn.Linear(C, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # x [B, N, 3], t [B]
        h, cond = self.embed(x), self.cond(t[:, None])
        rope = torch.linspace(0.5, 1.5, x.shape[1])[:, None].expand(-1, 1)  # [N, 1]
        for block in self.blocks:
            h = block(h, cond, rope)
        return self.proj_out(self.norm_out(h))


def _loss_grads(model: nn.Module, x: torch.Tensor, t: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = (model(x, t) - x.flip(1)).square().sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _tokens() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Toy()
    x, t = torch.randn(2, 8, 3), torch.rand(2)
    ref_loss, ref = _loss_grads(model, x, t)
    handle = lp.apply_sp(model, PLAN, dist.group.WORLD)
    loss, grads = _loss_grads(model, x, t)
    for g in grads.values():  # FSDP sums the gradients over the dp_shard x sp mesh
        dist.all_reduce(g)
    try:
        model(torch.randn(2, 7, 3), t)  # 7 tokens do not split over 2 ranks
        odd = ""
    except ValueError as e:
        odd = str(e)
    handle.remove()
    after, _ = _loss_grads(model, x, t)
    worst = max(float((grads[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    return {"loss": loss, "ref": ref_loss, "worst": worst, "restored": after == ref_loss,
            "modules": len(handle.modules), "odd": odd}  # fmt: skip


def _heads() -> dict[str, Any]:
    model = Toy()
    model.blocks[1].attn.heads = 3  # 3 heads cannot split over 2 ranks
    try:
        lp.apply_sp(model, PLAN, dist.group.WORLD)
    except ValueError as e:
        return {"error_text": str(e)}
    return {"error_text": ""}


def run(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_cases([("tokens", _tokens), ("heads", _heads)])
