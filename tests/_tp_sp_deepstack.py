"""A worker scenario of test_ep_tp.py (2-rank spawn): Qwen3-VL's own ``sp_deepstack`` TP style
on its own, in both forms Qwen3-VL's decoder hands it, against upstream's ``_deepstack_process``
on the whole sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lmms_parallel as lp


def sp_deepstack_forms(_out: Path) -> dict[str, Any]:
    """``sp_scatter_input`` on a stand-in layer splits a ``[1, 37, H]`` row (19 / 18 rows), then
    the rank's deepstack addition: a boolean mask (upstream's merge) and long positions (the host
    merge; out of order, as images then videos) across both ranks' rows, and positions on rank
    0's rows only (rank 1 adds nothing, yet takes part in the gradient's sum). Per rank: the
    largest difference of its output rows, and of the whole gradients of the hidden states and
    the features, from upstream's on the whole row (both ranks' losses summed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    class Text(nn.Module):  # a decoder with upstream's deepstack method and one (identity) layer
        _deepstack_process = Qwen3VLTextModel._deepstack_process

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Identity()])

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    text = Text()
    from lmms_models import get_model_spec

    styles = get_model_spec("qwen3_vl").plan_styles()  # the family's own style
    plan = {"layers.0": "sp_scatter_input", "": "sp_deepstack"}
    names = lp.apply_tp(text, plan, mesh, styles=styles)
    lo, hi = (0, 19) if dist.get_rank() == 0 else (19, 37)
    gen = torch.Generator().manual_seed(5)
    t, h = 37, 8
    out: dict[str, Any] = {"names": names}
    cases = {
        "mask": torch.tensor([3, 4, 5, 17, 18, 19, 20, 30]),
        "positions": torch.tensor([30, 31, 3, 4, 5, 17, 18, 19, 20]),
        "positions_rank0": torch.tensor([2, 9, 10, 11]),
    }
    for case, pos in cases.items():
        hidden = torch.randn(1, t, h, generator=gen)
        feats = torch.randn(pos.numel(), h, generator=gen)
        weight = torch.randn(1, t, h, generator=gen)
        mask = torch.zeros(1, t, dtype=torch.bool)
        mask[0, pos] = True
        order = pos.argsort()  # upstream takes the features in mask (position) order
        ref_h, ref_f = hidden.clone().requires_grad_(), feats.clone().requires_grad_()
        ref = Text._deepstack_process(Text(), ref_h, mask, ref_f[order])
        (ref * weight).sum().backward()
        got_h, got_f = hidden.clone().requires_grad_(), feats.clone().requires_grad_()
        local = text.layers[0](got_h)  # [1, T_r, H]
        if case == "mask":
            got = text._deepstack_process(local, mask, got_f[order])
        else:
            got = text._deepstack_process(local, pos, got_f)
        (got * weight[:, lo:hi]).sum().backward()
        out[case] = {
            "rows": list(got.shape),
            "out": float((got - ref[:, lo:hi]).detach().abs().max()),
            "g_hidden": float((got_h.grad - ref_h.grad).abs().max()),
            "g_feats": float((got_f.grad - ref_f.grad).abs().max()),
        }
    return out
