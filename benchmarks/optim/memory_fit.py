"""Bytes per parameter of each optimizer configuration, and whether a full fine-tune fits one GPU.

An *estimate* from the model's config (parameters counted from it, nothing built)
and a stated activation model, for the issue-29 target "Qwen2.5-VL-7B, every parameter trained,
16k tokens per step, one H200": which optimizer configuration leaves room for the activations.
The real peak is measured on the GPU (`benchmarks/device/session.sh`, stage `round2`, case
`vl7b_16k`); this script says what to expect and why.

Per trainable parameter, one process, one micro-batch per step (GA 1):

| configuration | compute weights | masters | gradient | moments |
| --- | --- | --- | --- | --- |
| fp32 masters + AdamW fp32 state (the trainer's default) | bf16 2 | fp32 4 | bf16 2 (cast deferred) | fp32 4 + 4 |
| fp32 masters + bf16 moments, stochastic rounding (`optimizer_state_dtype: bfloat16`) | 2 | 4 | 2 | bf16 2 + 2 |
| bf16 weights + bf16 moments, stochastic rounding, no masters (`LowPrecisionAdamW` on bf16 parameters; not a trainer option) | 2 | - | 2 | 2 + 2 |
| fp32 masters + Muon fp32 momentum (matrices; AdamW on the rest) | 2 | 4 | 2 | fp32 4 |

With GA > 1 the fp32 master gradient is kept across micro-batches: +4 B/param (the bf16 one
is then transient).

Activations at T tokens per step (bf16), from measured anchors rather than a first-principles
count: an un-checkpointed Qwen2.5-3B decoder block keeps ~1.45 GiB per 16k tokens
(benchmarks/models/NOTES.md, round 6), scaled to other widths by (10·H + 3·I); a checkpointed
block keeps its input, 2·H bytes per token; the block being recomputed holds one un-checkpointed
block's worth twice (forward then backward). The vision tower of Qwen2.5-VL (the same at 3B and
7B) with every block checkpointed: its inputs (~1.7 patches per text token in the bench data, 2
bytes x 1280) plus one block's working set. The LM head: the Triton linear cross-entropy's 1 GiB
logits buffer, the fp32 [V, H] weight gradient and the [T, H] hidden gradient. Plus 8% for the
allocator (expandable segments).

    uv run --all-packages python benchmarks/optim/memory_fit.py            # VL-7B and VL-3B
    uv run --all-packages python benchmarks/optim/memory_fit.py --tokens 32768 --usable-gib 139
"""

from __future__ import annotations

import argparse
from typing import Any

GIB = 2**30
# bytes per trainable parameter at GA 1: (compute weights, masters, gradient, optimizer state)
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "fp32 masters + AdamW fp32 state (default)": (2, 4, 2, 8),
    "fp32 masters + AdamW bf16 moments, SR (optimizer_state_dtype: bfloat16)": (2, 4, 2, 4),
    "bf16 weights + bf16 moments, SR, no masters (LowPrecisionAdamW on bf16)": (2, 0, 2, 4),
    "fp32 masters + Muon fp32 momentum (AdamW fp32 on non-matrices)": (2, 4, 2, 4),
}
# Published Qwen2.5-VL-7B-Instruct text shape (the vision tower is the 3B's but for its output
# width); random weights for benchmarks
VL7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 tie_word_embeddings=False)  # fmt: skip
PATCHES_PER_TOKEN = 1.7  # vision patches per text-decoder token in bench_train's VL packs
ANCHOR = (1.45 * GIB / 16384, 2048, 11008)  # bytes per token of an un-checkpointed 3B block


VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, patch_size=14,
              temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
VL3B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                 num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 tie_word_embeddings=True)  # fmt: skip


def vl_config(text: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL config (the fields this script reads): `text` and the shared tower."""
    return {
        "text_config": dict(text),
        "vision_config": {**VISION, "out_hidden_size": text["hidden_size"]},
    }


def count_params(conf: dict[str, Any]) -> int:
    """Qwen2.5-VL's parameters from its config: the text decoder (embedding, q/k/v with biases,
    o, SwiGLU MLP, two RMSNorms per layer, final norm, an untied LM head) and the vision tower
    (Conv3d patch embedding, 32 blocks of RMSNorms, qkv and proj with biases and a SwiGLU MLP
    with biases, the patch merger). Gives 3,754,622,976 for the 3B shape (bench_muon's 3.75B
    counted on the built model) and 8.29B for the 7B."""
    t, v = conf["text_config"], conf["vision_config"]
    h, i, nh, kv = (
        t["hidden_size"],
        t["intermediate_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
    )
    d = h // nh
    layer = h * h + h + 2 * (h * kv * d + kv * d) + h * h + 3 * h * i + 2 * h
    text = (
        t["vocab_size"] * h * (1 if t["tie_word_embeddings"] else 2)
        + t["num_hidden_layers"] * layer
        + h
    )
    c, vi = v["hidden_size"], v["intermediate_size"]
    block = 2 * c + c * 3 * c + 3 * c + c * c + c + 2 * (c * vi + vi) + vi * c + c
    m = c * v["spatial_merge_size"] ** 2
    merger = c + m * m + m + m * v["out_hidden_size"] + v["out_hidden_size"]
    patch = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2 * c
    return text + patch + v["depth"] * block + merger


def activation_bytes(conf: dict[str, Any], tokens: int, ac_fraction: float) -> dict[str, float]:
    """The activation model of the module doc, by part (bytes)."""
    text, vis = conf["text_config"], conf["vision_config"]
    h, i, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    per_tok, h0, i0 = ANCHOR
    block = per_tok * (10 * h + 3 * i) / (10 * h0 + 3 * i0) * tokens  # one un-checkpointed block
    n_ac = round(layers * ac_fraction)
    patches = PATCHES_PER_TOKEN * tokens
    vblock = per_tok * (10 * vis["hidden_size"] + 3 * vis["intermediate_size"]) / (
        10 * h0 + 3 * i0
    ) * patches  # fmt: skip
    v = text["vocab_size"]
    return {
        "decoder, checkpointed blocks' inputs": n_ac * 2 * h * tokens,
        "decoder, blocks not checkpointed": (layers - n_ac) * block,
        "decoder, recompute working set": 2 * block if n_ac else 0.0,
        "vision tower (all blocks checkpointed)": vis["depth"] * 2 * vis["hidden_size"] * patches
        + 2 * vblock,
        "LM head: logits buffer + fp32 weight grad + hidden grad": GIB + 4 * v * h + 2 * tokens * h,
    }


def report(name: str, conf: dict[str, Any], tokens: int, ac: float, usable_gib: float) -> str:
    n = count_params(conf)
    acts = activation_bytes(conf, tokens, ac)
    act = sum(acts.values()) * 1.08
    lines = [
        f"## {name}: {n / 1e9:.2f}B parameters, {tokens} tokens per step, "
        f"{ac:.0%} of decoder blocks checkpointed",
        "",
        "| part | GiB |",
        "| --- | --- |",
        *[f"| {k} | {b / GIB:.1f} |" for k, b in acts.items()],
        f"| activations + 8% allocator | {act / GIB:.1f} |",
        "",
        "| optimizer configuration | B/param | weights+state GiB | + activations GiB | "
        f"fits {usable_gib:.0f} GiB? |",
        "| --- | --- | --- | --- | --- |",
    ]
    t = conf["text_config"]
    emb = t["vocab_size"] * t["hidden_size"] * (1 if t["tie_word_embeddings"] else 2)
    for cname, parts in CONFIGS.items():
        b = sum(parts)
        state = n * b / GIB
        if "Muon" in cname:  # the embedding and the LM head take AdamW: 4 B more each
            state += emb * 4 / GIB
        total = state + act / GIB
        verdict = f"yes ({usable_gib - total:.0f} GiB left)" if total <= usable_gib else (
            f"no ({total - usable_gib:.0f} GiB over)"
        )  # fmt: skip
        lines.append(f"| {cname} | {b} | {state:.1f} | {total:.1f} | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ac-fraction", type=float, default=1.0, help="decoder blocks checkpointed")
    p.add_argument(
        "--usable-gib", type=float, default=139.0,
        help="GPU memory torch can allocate (H200: 141 GB on the datasheet, ~139 GiB usable)",
    )  # fmt: skip
    args = p.parse_args()
    print(report("Qwen2.5-VL-7B shape", vl_config(VL7B_TEXT), args.tokens, args.ac_fraction,
                 args.usable_gib))  # fmt: skip
    print()
    print(report("Qwen2.5-VL-3B shape (for scale)", vl_config(VL3B_TEXT), args.tokens,
                 args.ac_fraction, args.usable_gib))  # fmt: skip


if __name__ == "__main__":
    main()
