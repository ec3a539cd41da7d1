"""Ulysses sequence parallelism: shard the tokens of one packed row over ``sp`` ranks.

Each rank holds ``T/sp`` consecutive tokens of the row for every layer; only attention needs the
whole sequence, so around it an all-to-all trades the sequence split for a head split
(``[T/sp, H, D] -> [T, H/sp, D]``), the registered varlen attention runs on the whole row with the
*global* ``cu_seqlens`` (no cross-document attention, packing unchanged), and a second all-to-all
trades back. Communication per layer is ``4 * T * H * D / sp`` elements per rank (q, k, v, out),
independent of the number of ranks in the all-to-all; memory of activations drops by ``sp``.

Pieces (all model-agnostic; the model spec names the module to slice):

- :class:`SequenceParallel` installs a forward pre-hook on the text decoder (the spec's
  ``sp_slice_module``) that pads the row to a multiple of ``sp`` and slices ``inputs_embeds`` /
  ``input_ids``, ``position_ids`` (``[1, T]`` or mRoPE ``[R, 1, T]``) to this rank's chunk. It
  runs after the multimodal merge, so media embeddings land on the right ranks.
- :class:`UlyssesAttention` is the attention wrapper for
  ``lmms_kernels.register_varlen_attention(wrapper=...)``.
- :func:`sp_shard_labels` gives the labels matching the local hidden states and
  :func:`sp_reduce_loss` sums loss and token counts over the SP group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SequenceParallel",
    "UlyssesAttention",
    "all_to_all_heads_to_seq",
    "all_to_all_seq_to_heads",
    "sp_pad_len",
    "sp_reduce_loss",
    "sp_shard_labels",
]

IGNORE_INDEX = -100


def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own adjoint, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[T/sp, H, D]`` (local tokens, all heads) -> ``[T, H/sp, D]`` (all tokens, local heads)."""
    sp, _ = _size_rank(group)
    t_local, heads, dim = x.shape
    if heads % sp:
        raise ValueError(f"{heads} heads cannot be split over sp={sp} ranks")
    x = x.reshape(t_local, sp, heads // sp, dim).transpose(0, 1)  # [sp, T/sp, H/sp, D]
    x = _AllToAll.apply(x, group)  # [sp (source rank = token chunk), T/sp, H/sp, D]
    return x.reshape(sp * t_local, heads // sp, dim)


def all_to_all_heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[T, H/sp, D]`` -> ``[T/sp, H, D]``; the inverse of :func:`all_to_all_seq_to_heads`."""
    sp, _ = _size_rank(group)
    total, heads_local, dim = x.shape
    x = x.reshape(sp, total // sp, heads_local, dim)  # [sp (token chunk), T/sp, H/sp, D]
    x = _AllToAll.apply(x, group)  # [sp (head group), T/sp, H/sp, D]
    return x.transpose(0, 1).reshape(total // sp, sp * heads_local, dim)


class UlyssesAttention:
    """Attention wrapper: all-to-all, inner varlen attention on the whole row, all-to-all back.

    Called as ``wrapper(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, inner)`` with
    local ``q [T/sp, H, D]``, ``k/v [T/sp, KV, D]`` and the *global* ``cu_seqlens`` of the row
    (before SP padding; the padding tail becomes its own segment here). KV heads are repeated
    when ``KV < sp`` (``sp % KV == 0`` required); ``H % sp == 0`` is required. With ``sp == 1`` it
    calls ``inner`` directly.
    """

    def __init__(self, sp_group: dist.ProcessGroup | None) -> None:
        self.group = sp_group
        self.sp, self.rank = _size_rank(sp_group)

    def __call__(
        self,
        q: torch.Tensor,  # [T/sp, H, D]
        k: torch.Tensor,  # [T/sp, KV, D]
        v: torch.Tensor,  # [T/sp, KV, D]
        cu_seqlens_q: torch.Tensor,  # [n+1] int32, global
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        softmax_scale: float | None = None,
        inner: Callable[..., torch.Tensor],
        **kwargs: Any,
    ) -> torch.Tensor:  # [T/sp, H, D]
        if self.sp == 1:
            return inner(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal=causal, softmax_scale=softmax_scale, **kwargs)  # fmt: skip
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % self.sp:
            raise ValueError(
                f"Ulysses SP needs attention heads ({heads}) divisible by sp={self.sp}"
            )
        if kv_heads < self.sp:
            if self.sp % kv_heads:
                raise ValueError(f"sp={self.sp} must be a multiple of the {kv_heads} KV heads")
            k = k.repeat_interleave(self.sp // kv_heads, dim=1)
            v = v.repeat_interleave(self.sp // kv_heads, dim=1)
        elif kv_heads % self.sp:
            raise ValueError(f"Ulysses SP needs KV heads ({kv_heads}) divisible by sp={self.sp}")
        q = all_to_all_seq_to_heads(q, self.group)  # [T, H/sp, D]
        k = all_to_all_seq_to_heads(k, self.group)
        v = all_to_all_seq_to_heads(v, self.group)
        total = q.shape[0]
        cu_q = _cover(cu_seqlens_q, total)
        cu_k = _cover(cu_seqlens_k, total)
        max_q = max(int(max_seqlen_q), total - int(cu_seqlens_q[-1]))
        max_k = max(int(max_seqlen_k), total - int(cu_seqlens_k[-1]))
        out = inner(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                    softmax_scale=softmax_scale, **kwargs)  # fmt: skip
        return all_to_all_heads_to_seq(out, self.group)  # [T/sp, H, D]


def _cover(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Append the SP padding tail as its own segment so that ``cu[-1] == total``."""
    last = int(cu[-1])
    if last == total:
        return cu
    if last > total:
        raise ValueError(f"cu_seqlens ends at {last} but the gathered row has only {total} tokens")
    return torch.cat([cu, cu.new_tensor([total])])


def sp_pad_len(length: int, sp: int) -> int:
    """Row length after padding to a multiple of ``sp``."""
    return -(-length // sp) * sp


def _pad_slice(x: torch.Tensor, dim: int, sp: int, rank: int, value: float) -> torch.Tensor:
    length = x.shape[dim]
    padded = sp_pad_len(length, sp)
    if padded != length:
        pad = [0, 0] * (x.ndim - 1 - (dim % x.ndim)) + [0, padded - length]
        x = F.pad(x, pad, value=value)
    chunk = padded // sp
    return x.narrow(dim, rank * chunk, chunk)


def sp_shard_labels(labels: torch.Tensor, sp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of ``labels`` / ``shift_labels`` (``[T]`` or ``[B, T]``), padded with -100.

    Matches the hidden states that come out of a model sliced by :class:`SequenceParallel`.
    """
    sp, rank = _size_rank(sp_group)
    if sp == 1:
        return labels
    return _pad_slice(labels, -1, sp, rank, IGNORE_INDEX)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward.

    Every rank backpropagates its *own* contribution; the gradient sum over the SP ranks is done
    by FSDP's reduce-scatter, so passing the gradient through unchanged is what makes the
    parameters' gradients equal the single-process run.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sp_reduce_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor | int, sp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the local ``loss_sum`` and token count over the SP group.

    Returns ``(loss_sum, num_tokens)`` of the whole row on every SP rank. The loss keeps an
    identity gradient to the local tokens (see ``_SumOverGroup``): with FSDP summing gradients,
    ``(loss_sum / global_tokens).backward()`` on every rank gives the single-process gradients.
    """
    sp, _ = _size_rank(sp_group)
    if not torch.is_tensor(num_tokens):
        num_tokens = torch.tensor(num_tokens, device=loss_sum.device)
    if sp == 1:
        return loss_sum, num_tokens
    counts = num_tokens.detach().clone()
    dist.all_reduce(counts, group=sp_group)
    return _SumOverGroup.apply(loss_sum, sp_group), counts


_SEQ_KWARGS_2D = ("input_ids", "attention_mask")  # [B, T]


class SequenceParallel:
    """Forward pre-hook on the text decoder slicing its inputs to this rank's chunk of the row.

    ``SequenceParallel(spec.sp_slice_module(model), sp_group).install()``; ``remove()`` undoes it.
    The hooked module is called with keyword arguments in the Hugging Face convention:
    ``inputs_embeds [1, T, Hd]`` or ``input_ids [1, T]``, ``position_ids [1, T]`` or
    ``[R, 1, T]`` (mRoPE; created as ``arange(T)`` when absent, before slicing, so positions stay
    global). The row is padded to a multiple of ``sp`` (zeros, position 0); the padding forms its
    own attention segment (see :class:`UlyssesAttention`) and its labels are -100.

    A keyword argument whose value has a method ``sp_slice(start, stop)`` is replaced by what that
    method returns for this rank's token range ``[start, stop)`` of the padded row: the protocol
    for sparse inputs indexed by row position (Qwen3-VL's deepstack features at visual positions)
    that the model, not this hook, knows how to cut.
    """

    def __init__(self, module: nn.Module, sp_group: dist.ProcessGroup | None) -> None:
        self.module = module
        self.group = sp_group
        self.sp, self.rank = _size_rank(sp_group)
        self._handle: Any = None

    def install(self) -> SequenceParallel:
        if self._handle is not None:
            raise RuntimeError("SequenceParallel is already installed")
        if self.sp > 1:
            self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> SequenceParallel:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:  # HF convention: the first positional argument is input_ids
            kwargs = {"input_ids": args[0], **kwargs}
            args = ()
        embeds = kwargs.get("inputs_embeds")
        ids = kwargs.get("input_ids")
        ref = embeds if embeds is not None else ids
        if ref is None:
            raise ValueError(
                "SequenceParallel: the hooked module got neither inputs_embeds nor input_ids"
            )
        if ref.shape[0] != 1:
            raise ValueError(
                f"SequenceParallel expects one packed row (batch 1), got batch {ref.shape[0]}"
            )
        length = ref.shape[1]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ref.device).unsqueeze(0)  # [1, T]
        if positions.shape[-1] != length:
            raise ValueError(
                f"position_ids has {positions.shape[-1]} positions for {length} tokens"
            )
        sp, rank = self.sp, self.rank
        kwargs["position_ids"] = _pad_slice(positions, -1, sp, rank, 0)
        if embeds is not None:
            kwargs["inputs_embeds"] = _pad_slice(embeds, 1, sp, rank, 0.0)
        for key in _SEQ_KWARGS_2D:
            value = kwargs.get(key)
            if torch.is_tensor(value):  # (a prepared {layer type: mask} mapping passes through)
                kwargs[key] = _pad_slice(value, 1, sp, rank, 0)
        cache_position = kwargs.get("cache_position")
        if cache_position is not None and cache_position.shape[-1] == length:
            kwargs["cache_position"] = _pad_slice(cache_position, -1, sp, rank, 0)
        chunk = sp_pad_len(length, sp) // sp
        for key, value in kwargs.items():  # row-indexed inputs that slice themselves
            if callable(getattr(value, "sp_slice", None)):
                kwargs[key] = value.sp_slice(rank * chunk, (rank + 1) * chunk)
        return args, kwargs
