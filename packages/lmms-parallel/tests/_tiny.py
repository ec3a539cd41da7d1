"""Tiny Qwen3 / Qwen2.5-VL models, packed rows and a per-segment SDPA attention for the tests.

The attention is registered with transformers' AttentionInterface here (the tests must not
depend on lmms-kernels): it reads the row's global cu_seqlens from ``STATE`` and, when
``STATE.wrapper`` is set, goes through it (the Ulysses wrapper), exactly like
``lmms_kernels.register_varlen_attention(wrapper=...)`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN = "lmms_parallel_test_varlen"
IMAGE_TOKEN = 120
VISION_START = 121


@dataclass
class _State:
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    wrapper: object = None


STATE = _State()


def sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale=None):
    """Reference varlen attention: SDPA per segment. q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
    heads, kv = q.shape[1], k.shape[1]
    out = []
    for i in range(cu_q.numel() - 1):
        s, e = int(cu_q[i]), int(cu_q[i + 1])
        qs = q[s:e].transpose(0, 1)  # [H, L, D]
        ks = k[s:e].transpose(0, 1).repeat_interleave(heads // kv, dim=0)
        vs = v[s:e].transpose(0, 1).repeat_interleave(heads // kv, dim=0)
        out.append(
            F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, scale=softmax_scale
            ).transpose(0, 1)
        )
    return torch.cat(out, dim=0)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query [1, H, L, D] -> [L, H, D]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    cu = STATE.cu_seqlens
    if cu is None:
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    fn = sdpa_varlen if STATE.wrapper is None else STATE.wrapper
    extra = {} if STATE.wrapper is None else {"inner": sdpa_varlen}
    out = fn(
        q,
        k,
        v,
        cu,
        cu,
        STATE.max_seqlen,
        STATE.max_seqlen,
        causal=True,
        softmax_scale=scaling,
        **extra,
    )
    return out.unsqueeze(0), None  # [1, L, H, D]


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, lambda *a, **k: None)


def qwen3_config(**over):
    from transformers import Qwen3Config

    cfg = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    cfg.update(over)
    return Qwen3Config(**cfg)


def vl_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
            window_size=8, fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip


def vl3_config():
    """Tiny Qwen3-VL: deepstack features of both vision blocks go into the first text layers."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                             "mrope_interleaved": True},
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip


def set_attention(model) -> None:
    """Text decoder through the test attention (registered here, so a test that runs alone
    finds it); the vision tower keeps SDPA."""
    register_attention()
    cfg = model.config
    text = getattr(cfg, "text_config", None)
    cfg._attn_implementation = ATTN
    if text is not None:
        text._attn_implementation = ATTN
        cfg.vision_config._attn_implementation = "sdpa"


def build(kind: str, device: str = "cpu", seed: int = 0):
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen3ForCausalLM,
        Qwen3VLForConditionalGeneration,
    )

    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(qwen3_config())
    elif kind == "vl3":
        model = Qwen3VLForConditionalGeneration(vl3_config())
    else:
        model = Qwen2_5_VLForConditionalGeneration(vl_config())
    set_attention(model)
    return model


def blocks(model, kind: str) -> tuple[list, list, list]:
    """(decoder blocks, vision blocks, embeddings): what a model spec would return."""
    if kind == "qwen3":
        return list(model.model.layers), [], [model.model.embed_tokens]
    inner = model.model
    return (
        list(inner.language_model.layers),
        list(inner.visual.blocks),
        [inner.language_model.embed_tokens],
    )


def sp_module(model, kind: str):
    return model.model if kind == "qwen3" else model.model.language_model


def _sample(gen, kind: str, n_text: int, grid: tuple[int, int, int] | None):
    """(input_ids [L], shift_labels [L], position_ids [R, L], pixel_values, grid)."""
    ids = torch.randint(0, 100, (n_text,), generator=gen)
    pixels = None
    if grid is not None:
        t, h, w = grid
        n_img = t * h * w // 4
        ids = torch.cat(
            [ids[:2], torch.tensor([VISION_START]), torch.full((n_img,), IMAGE_TOKEN), ids[2:]]
        )
        pixels = torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=gen)
    length = ids.numel()
    if kind == "qwen3":
        pos = torch.arange(length)[None]
    else:
        pos = torch.arange(length).repeat(4, 1)
        if grid is not None:
            t, h, w = grid
            start = 3
            hh, ww = h // 2, w // 2
            tt = torch.arange(t).repeat_interleave(hh * ww)
            yy = torch.arange(hh).repeat_interleave(ww).repeat(t)
            xx = torch.arange(ww).repeat(hh * t)
            pos[1:, start : start + t * hh * ww] = torch.stack([tt, yy, xx]) + start
            tail = start + t * hh * ww
            pos[1:, tail:] = torch.arange(length - tail) + start + max(t, hh, ww)
    shift = torch.cat([ids[1:], torch.tensor([-100])])
    shift[ids == IMAGE_TOKEN] = -100
    shift[torch.cat([ids[1:] == IMAGE_TOKEN, torch.tensor([False])])] = -100
    return ids, shift, pos, pixels, grid


def make_row(kind: str, seed: int, *, n_samples: int = 3, images: bool = True) -> dict:
    """One packed row: samples of 5..13 text tokens, every other one with a 1x4x4 image."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for i in range(n_samples):
        n_text = int(torch.randint(5, 14, (1,), generator=gen))
        grid = (1, 4, 4) if (images and kind != "qwen3" and i % 2 == 0) else None
        parts.append(_sample(gen, kind, n_text, grid))
    lens = [p[0].numel() for p in parts]
    row = {
        "input_ids": torch.cat([p[0] for p in parts]),
        "shift_labels": torch.cat([p[1] for p in parts]),
        "position_ids": torch.cat([p[2] for p in parts], dim=-1),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "max_seqlen": max(lens),
    }
    pix = [p[3] for p in parts if p[3] is not None]
    if pix:
        row["pixel_values"] = torch.cat(pix)
        row["image_grid_thw"] = torch.tensor([p[4] for p in parts if p[4] is not None])
    return row


def row_loss(model, row: dict, sp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss over this rank's tokens, number of loss tokens) of one packed row."""
    from lmms_parallel import sp_shard_labels

    STATE.cu_seqlens, STATE.max_seqlen = row["cu_seqlens"], row["max_seqlen"]
    pos = row["position_ids"]
    kwargs = {
        "input_ids": row["input_ids"][None],
        "position_ids": pos[:, None] if pos.ndim == 2 and pos.shape[0] == 4 else pos,
    }
    if "pixel_values" in row:
        kwargs.update(pixel_values=row["pixel_values"], image_grid_thw=row["image_grid_thw"])
    logits = model(**kwargs, use_cache=False).logits[0].float()  # [T_local, V]
    labels = sp_shard_labels(row["shift_labels"], sp_group)
    loss_sum = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


def reference_losses(
    kind: str, rows_per_step: list[list[dict]], *, lr: float = 1e-3, seed: int = 0
) -> list[float]:
    """Single-process losses: per step, gradient accumulation over the step's rows."""
    model = build(kind, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for rows in rows_per_step:
        sums, counts = [], []
        for row in rows:
            s, n = row_loss(model, row)
            sums.append(s)
            counts.append(n)
        total = sum(int(c) for c in counts)
        loss = sum(sums) / total
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b)
    )
