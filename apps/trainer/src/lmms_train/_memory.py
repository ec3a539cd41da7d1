"""The memory plan: peak device memory per GPU, predicted before the model is built.

`model_facts` builds the model on the meta device (no weights, no GPU) and counts its
parameters by part; the family's `ModelSpec.memory_towers` gives the block shapes from which
`lmms_models.TowerShape` counts the activations one block keeps. `plan_memory` walks one training
step of a layout (precision, activation checkpointing, FSDP degree, offload) and returns the peak
split into weights, gradients, optimizer state, master weights, activations (per tower, the LM
head's fused loss), communication buffers and an allocator margin. `lmms-train plan` prints it;
the trainer's preflight stops a run that would not fit and `trainer_args.memory: auto` picks the
fastest layout that does (`_memory_auto`). Accuracy against measured peaks: benchmarks/RESULTS.md.

The step it walks (bf16 compute, one micro-batch per rank): the forward keeps every block's
activations (a checkpointed block only its input); the backward starts with all of them plus the
fused linear cross-entropy's buffers (the Triton kernel's 1 GiB logits chunk, the fp32 weight
gradient of the head, the hidden gradient: never [T, vocab]), then frees the decoder's blocks
from the top while their gradients appear, a checkpointed block recomputed while its backward
runs; the media towers' backward comes last, with the decoder's gradients held. The optimizer
step holds every gradient. The peak is the largest of these moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lmms_train.config import TrainConfig

__all__ = [
    "Layout",
    "MemoryPlan",
    "ModelFacts",
    "device_gib",
    "fsdp_shards",
    "layout_of",
    "model_facts",
    "plan_memory",
    "state_bytes",
    "tower_tokens",
]

GIB = 2**30
#: Logits chunk of lmms_kernels' Triton linear cross-entropy (bytes, whatever T)
LOSS_CHUNK_BYTES = GIB
#: Head dims FA4 computes (lmms_kernels pads others up to the next one, and keeps the padded
#: q/k/v/out for backward)
FA4_HEAD_DIMS = (64, 128)
#: Device memory outside torch's allocator (CUDA context, cuBLAS and NCCL workspaces), and the
#: allocator's slack over the allocated peak with expandable segments
CONTEXT_BYTES = 1.0 * GIB
ALLOCATOR_MARGIN = 0.04
#: An H100 80 GB as torch sees it (`total_memory`, GiB)
DEFAULT_GPU_GIB = 79.2


@dataclass(kw_only=True, slots=True)
class ModelFacts:
    """Parameter counts of the built model (meta device) and its block shapes."""

    total: int
    trainable: int
    towers: dict[str, Any]  # name -> lmms_models.TowerShape (empty: activations unknown)
    blocks: dict[str, list[tuple[int, int]]]  # tower -> (params, trainable) per block
    head: tuple[int, int]  # (vocab, hidden) of the LM head
    tied: bool
    matrix_trainable: int  # trainable params of >= 2 dims inside blocks (Muon's share)
    why_unknown: str = ""


@dataclass(kw_only=True, slots=True)
class Layout:
    """The settings a plan depends on (from trainer_args, or chosen by `memory: auto`)."""

    tokens: int
    media_share: float
    gpus: int = 1
    fsdp: bool = False
    dp_replicate: int = 1
    tp: int = 1
    sp: int = 1
    ep: int = 1
    bf16: bool = True
    optimizer: str = "adamw"
    state_dtype: str = "float32"
    ga: int = 1
    offload: bool = False
    ac: dict[str, tuple[str, float]] = field(default_factory=dict)  # tower -> (mode, fraction)
    attn: dict[str, str] = field(default_factory=dict)  # tower -> attention backend

    def describe(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"]
        if not self.fsdp:
            parts.append("one process, fp32 masters")
        elif self.gpus > 1 and self.dp_replicate > 1:
            shards = fsdp_shards(self)
            parts.append(f"FSDP2 sharded over {shards} x replicated {self.dp_replicate}"
                         if shards > 1 else f"FSDP2 replicated {self.dp_replicate} (no sharding)")  # fmt: skip
        else:
            parts.append("FSDP2")
        parts.append(f"{self.optimizer} state {self.state_dtype}")
        for tower, (mode, frac) in self.ac.items():
            parts.append(f"{tower} AC {mode}" + (f" {frac:g}" if mode != "none" else ""))
        if self.offload:
            parts.append("CPU offload")
        return ", ".join(parts)


@dataclass(kw_only=True, slots=True)
class MemoryPlan:
    layout: Layout
    parts: dict[str, float]  # bytes at the peak moment, by part
    per_block: dict[str, str]  # tower -> one line on its blocks
    peak: float  # allocated bytes at the peak (what torch.cuda.max_memory_allocated reports)
    moment: str  # when the peak happens
    capacity: float  # device memory (bytes)
    notes: list[str] = field(default_factory=list)

    @property
    def needed(self) -> float:
        """Device memory the run needs: the allocated peak, the allocator margin, the context."""
        return self.peak * (1 + ALLOCATOR_MARGIN) + CONTEXT_BYTES

    @property
    def fits(self) -> bool:
        return self.needed <= self.capacity

    def text(self) -> str:
        g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
        lines = [f"memory plan: {self.layout.describe()}, {self.layout.tokens} tokens per pack"]
        if self.layout.media_share:
            lines[0] += f", media share {self.layout.media_share:g}"
        lines.append(f"  {'part':<44} GiB/GPU")
        for name, b in self.parts.items():
            lines.append(f"  {name:<44} {g(b):>7}")
        lines.append(f"  {'peak allocated (' + self.moment + ')':<44} {g(self.peak):>7}")
        margin = self.peak * ALLOCATOR_MARGIN
        lines.append(
            f"  {'allocator margin (4%) + CUDA context':<44} {g(margin + CONTEXT_BYTES):>7}"
        )
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(
            f"  {'needed per GPU':<44} {g(self.needed):>7}  of {g(self.capacity)}: {verdict}"
        )
        for tower, line in self.per_block.items():
            lines.append(f"  {tower}: {line}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


# ---------------------------------------------------------------- the model, on meta
def model_facts(cfg: TrainConfig, spec: Any, token_ids: dict[str, Any] | None = None) -> ModelFacts:
    """Build the configured model on the meta device (no memory, no GPU), add its LoRA adapters
    and freeze as configured, and count its parameters by part (a QLoRA base is counted at its
    compute dtype: an overestimate)."""
    from lmms_train._model_setup import _freeze, model_config_dict

    m = cfg.model_config
    if m.load_from_config is not None:
        conf = model_config_dict(cfg, spec, token_ids)
        model = spec.build(config=conf, device="meta", attn_backend="sdpa")
    else:
        model = spec.build(
            pretrained=m.load_from_pretrained_path, device="meta", attn_backend="sdpa"
        )
    from lmms_train._lora_setup import apply_model_lora

    apply_model_lora(cfg, spec, model)  # LoRA: the base frozen, the adapters trainable
    _freeze(model, spec, cfg.trainer_args.freeze)
    params = list(model.parameters())
    try:
        towers = dict(spec.memory_towers(model.config))
        why = ""
    except (NotImplementedError, AttributeError, TypeError) as exc:
        towers, why = {}, f"{spec.name} gives no block shapes ({exc})"
    blocks = {"decoder": spec.decoder_blocks(model), "vision": spec.vision_blocks(model)}
    count = lambda mod, trainable=False: sum(  # noqa: E731
        p.numel() for p in mod.parameters() if p.requires_grad or not trainable
    )
    head = spec.lm_head(model)
    weight = getattr(head, "weight", None)
    vocab, hidden = (tuple(weight.shape) if weight is not None else (0, 0))[:2] or (0, 0)
    emb_ids = {id(p) for e in spec.embeddings(model) for p in e.parameters()}
    tied = weight is not None and id(weight) in emb_ids
    matrices = sum(
        p.numel()
        for blist in blocks.values()
        for b in blist
        for p in b.parameters()
        if p.requires_grad and p.ndim >= 2
    )
    return ModelFacts(
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        towers=towers,
        blocks={k: [(count(b), count(b, True)) for b in v] for k, v in blocks.items() if v},
        head=(int(vocab), int(hidden)),
        tied=tied,
        matrix_trainable=matrices,
        why_unknown=why,
    )


def layout_of(cfg: TrainConfig, *, gpus: int = 1) -> Layout:
    """The layout `cfg` asks for on `gpus` GPUs (FSDP2 when several, or when set)."""
    from lmms_train._model_setup import ac_plan

    t, d = cfg.trainer_args, cfg.dataset_config
    attn = _resolved(t.attn_backend if t.use_rmpad else "sdpa")
    return Layout(
        tokens=d.packing_length,
        media_share=t.memory_media_share,
        gpus=gpus,
        fsdp=bool(t.fsdp) or gpus > 1 or t.fsdp_cpu_offload,
        dp_replicate=t.dp_replicate,
        tp=t.tp_degree,
        sp=t.sp_ulysses_degree,
        ep=t.ep_degree,
        bf16=t.bf16,
        optimizer=t.optimizer,
        state_dtype=t.optimizer_state_dtype,
        ga=t.gradient_accumulation_steps,
        offload=t.fsdp_cpu_offload,
        ac=ac_plan(t),
        attn={"decoder": attn, "vision": _resolved(t.vision_attn_backend or attn)},
    )


def _resolved(backend: str) -> str:
    """`auto` as it resolves on this machine's GPU (FA4 pads head dims to 64 or 128, torch's
    and flash-attn's varlen kernels do not); without a GPU (`lmms-train plan` on a laptop)
    `auto` stays, planned as FA4."""
    if backend != "auto" or not torch.cuda.is_available():
        return backend
    try:
        from lmms_kernels import resolve_backend
    except ImportError:
        return backend
    return resolve_backend("auto", "cuda", torch.bfloat16)


# ---------------------------------------------------------------- the plan
def _padded_head_dim(backend: str, head_dim: int) -> int | None:
    if backend not in ("auto", "fa4"):
        return None
    return next((s for s in FA4_HEAD_DIMS if s >= head_dim), None)


def tower_tokens(name: str, shape: Any, lay: Layout) -> float:
    per_rank = lay.tokens / lay.sp
    if shape.tokens_per_media_token is None:
        return per_rank
    return per_rank * lay.media_share * shape.tokens_per_media_token


def _activations(facts: ModelFacts, lay: Layout) -> dict[str, dict[str, float]]:
    """Per tower: bytes kept by the forward (`kept`), one block's full set (`block`), the
    recompute working set in its backward (`work`) and a line for the report."""
    out: dict[str, dict[str, float]] = {}
    for name, shape in facts.towers.items():
        tokens = tower_tokens(name, shape, lay)
        pad = _padded_head_dim(lay.attn.get(name, "auto"), shape.head_dim)
        per_tok = shape.saved_bytes_per_token(pad) / lay.tp
        block = per_tok * tokens
        mode, frac = lay.ac.get(name, ("none", 1.0))
        n = shape.layers
        n_ac = 0 if mode == "none" else math.floor(n * frac)
        if mode == "selective":  # matmul outputs kept; element-wise ops, attention recomputed
            kept_ac = _selective_bytes_per_token(shape) * tokens
        else:
            kept_ac = 2 * shape.hidden * tokens  # the block's input
        kept = (n - n_ac) * block + n_ac * kept_ac
        work = block * (1.5 if n_ac else 0.5)  # recomputed set + the backward's temporaries
        frozen = name != "decoder" and not any(t for _, t in facts.blocks.get(name, []))
        if frozen:  # a frozen media tower runs before anything trained: autograd keeps nothing
            kept = work = 0.0
        out[name] = {"kept": kept, "block": block, "work": work, "tokens": tokens, "n_ac": n_ac}
    return out


def _selective_bytes_per_token(shape: Any) -> float:
    """What a block under selective checkpointing keeps per token (bf16): its input, the q/k/v
    projections' outputs (unpadded: the attention kernel's padded copies are recomputed with
    it), the output projection's output and the MLP's up projections (gate and up, or fc1);
    the down projection's output is not kept (nothing in the block's backward reads it). As
    Inductor's partitioner saves it for a compiled Qwen2 block (CPU trace, 2026-12-05)."""
    q, kv = shape.attention_width(None)
    inter = shape.intermediate * max(1, shape.experts_per_token)
    ups = (2 if shape.gated_mlp else 1) * inter
    return 2.0 * (shape.hidden + q + 2 * kv + shape.hidden + ups)


def state_bytes(facts: ModelFacts, lay: Layout) -> dict[str, float]:
    """Weights, masters, gradients and optimizer state per GPU, before sharding."""
    p_all, p_tr = facts.total, facts.trainable
    if lay.optimizer == "muon":
        state = 4 * facts.matrix_trainable + 8 * (p_tr - facts.matrix_trainable)
    else:
        state = (4 if lay.state_dtype == "bfloat16" else 8) * p_tr
    if not lay.bf16:
        return {
            "weights": 4 * p_all,
            "master weights": 0,
            "gradients": 4 * p_tr,
            "optimizer": state,
        }
    if lay.fsdp:  # sharded fp32 parameters are the masters; fp32 reduce-scattered gradients
        return {"weights": 4 * (p_all - p_tr), "master weights": 4 * p_tr, "gradients": 4 * p_tr,
                "optimizer": state}  # fmt: skip
    grads = (4 if lay.ga > 1 else 2) * p_tr  # bf16 kept for one micro-batch, fp32 across several
    return {
        "weights": 2 * p_all,
        "master weights": 4 * p_tr,
        "gradients": grads,
        "optimizer": state,
    }


def fsdp_shards(lay: Layout) -> int:
    return max(1, lay.gpus // (lay.dp_replicate * lay.tp)) if lay.fsdp else 1


def _comm_bytes(facts: ModelFacts, lay: Layout) -> float:
    """FSDP2's unsharded bf16 blocks (the one computing and the one prefetched), the root module
    (embeddings, head) gathered through the step, and the reduce-scatter input of two blocks."""
    if not lay.fsdp:
        return 0.0
    biggest = max((p for blist in facts.blocks.values() for p, _ in blist), default=0) / lay.tp
    in_blocks = sum(p for blist in facts.blocks.values() for p, _ in blist)
    root = facts.total - in_blocks
    return 2 * 2 * biggest + 2 * root + 2 * 2 * biggest


def plan_memory(facts: ModelFacts, lay: Layout, capacity_gib: float) -> MemoryPlan:
    """The peak of one training step of `lay` per GPU (see the module doc)."""
    shards = fsdp_shards(lay)
    state = {k: (0.0 if lay.offload else v / shards) for k, v in state_bytes(facts, lay).items()}
    grads_all = state.pop("gradients")
    base = {**state, "communication buffers (FSDP2)": _comm_bytes(facts, lay)}
    acts = _activations(facts, lay)
    vocab, hidden = facts.head
    dec = acts.get("decoder")
    tokens = dec["tokens"] if dec else lay.tokens / lay.sp
    head_grad = 0.0 if lay.offload else 2 * vocab * hidden / shards
    loss = LOSS_CHUNK_BYTES + 4 * vocab * hidden / lay.tp + 4 * tokens * hidden
    kept = {f"activations: {k} ({a['n_ac']:.0f} blocks checkpointed)": a["kept"]
            for k, a in acts.items()}  # fmt: skip
    media = [k for k in acts if k != "decoder"]
    dec_grads = grads_all * (1.0 - _media_share_of_params(facts, media))
    moments: dict[str, dict[str, float]] = {
        "backward start": {"gradients": head_grad, **kept, "fused loss buffers": loss},
        "optimizer step": {"gradients": grads_all},
    }
    if dec:
        moments["decoder backward"] = {"gradients": head_grad, **kept, "recompute": dec["work"]}
    for name in media:
        held = {k: v for k, v in kept.items() if not k.startswith("activations: decoder")}
        moments[f"{name} backward"] = {
            "gradients": dec_grads + head_grad,
            **held,
            "recompute": acts[name]["work"],
        }
    moment = max(moments, key=lambda k: sum(moments[k].values()))
    parts = {k: v for k, v in {**base, **moments[moment]}.items() if v or k in state}
    notes = [facts.why_unknown] if facts.why_unknown else []
    if lay.tp > 1 or lay.ep > 1:
        notes.append("TP/EP: activations divided by the TP degree (approximate)")
    per_block = {
        name: f"{facts.towers[name].layers} blocks, {a['tokens']:.0f} tokens per GPU, "
        f"{a['block'] / GIB:.2f} GiB per un-checkpointed block, "
        f"{a['n_ac']:.0f} checkpointed"
        for name, a in acts.items()
    }
    return MemoryPlan(layout=lay, parts=parts, per_block=per_block, peak=sum(parts.values()),
                      moment=moment, capacity=capacity_gib * GIB, notes=notes)  # fmt: skip


def _media_share_of_params(facts: ModelFacts, media: list[str]) -> float:
    """Fraction of the trainable parameters in the media towers' blocks."""
    inside = sum(t for k in media for _, t in facts.blocks.get(k, []))
    return inside / max(1, facts.trainable)


def device_gib() -> float | None:
    """Memory of this process's CUDA device (GiB), or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
