"""The Muon optimizer (with an AdamW side for non-matrix parameters) as one torch Optimizer."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from ._common import closure_loss
from ._ns import (
    Backend,
    Coefficients,
    Method,
    NSSchedule,
    _gram_symmetric,
    _ns_gram,
    _ns_stack,
    _use_gram,
    newton_schulz,
    resolve_schedule,
)

__all__ = ["Muon", "lr_scale"]

_ADJUST_MODES = (None, "none", "original", "rms", "spectral")


def lr_scale(adjust_lr: str | None, shape: Sequence[int]) -> float:
    """Multiplier on the Muon lr for a matrix of ``shape`` ``[fan_out, fan_in, ...]``.

    - ``None`` / ``"none"``: 1 (the orthogonal update has spectral norm ~1).
    - ``"original"``: ``sqrt(max(1, fan_out / fan_in))`` (Keller Jordan's reference code).
    - ``"rms"``: ``0.2 · sqrt(max(fan_out, fan_in))``: update RMS ≈ 0.2 like AdamW's, so AdamW
      learning rates and weight decay transfer (Moonlight, Liu et al. 2025).
    - ``"spectral"``: ``sqrt(fan_out / fan_in)`` (the spectral-condition scaling).
    """
    fan_out = shape[0]
    fan_in = math.prod(shape[1:])
    if adjust_lr in (None, "none"):
        return 1.0
    if adjust_lr == "original":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if adjust_lr == "rms":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if adjust_lr == "spectral":
        return math.sqrt(fan_out / fan_in)
    raise ValueError(f"adjust_lr must be one of {_ADJUST_MODES}, got {adjust_lr!r}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (shares storage under no_grad), or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # type: ignore[attr-defined]


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "placements")


def _needs_gather(p: torch.Tensor) -> bool:
    """Whether a parameter's rows are spread over several ranks (NS needs them gathered).

    False for plain tensors and for DTensors whose local tensor is the whole matrix: replicated,
    or sharded over a mesh dim of size 1 (FSDP2 on one GPU). Those take the local, batched path
    instead of a per-matrix NS. Unsupported placements raise here, whatever the mesh size.
    """
    if not _is_dtensor(p):
        return False
    from ._distributed import _shard_dim, is_tensor_parallel

    if is_tensor_parallel(p):
        return True  # orthogonalised as the whole matrix (_distributed.orthogonalize_full)

    dim = _shard_dim(p)
    return dim is not None and p.device_mesh.size(dim) > 1  # type: ignore[attr-defined]


class Muon(Optimizer):
    """Muon (momentum → Newton–Schulz orthogonalisation) for matrices, AdamW for the rest.

    Every param group carries ``use_muon``. Groups without it are split: parameters with
    ``ndim == 2`` take Muon, the others AdamW (use :func:`build_muon_param_groups` for a model:
    it also sends embeddings and output heads to AdamW). Muon groups read ``lr``, ``momentum``,
    ``nesterov``, ``ns_steps``, ``ns_coefficients``, ``weight_decay``, ``adjust_lr``; AdamW
    groups read ``lr``, ``betas``, ``eps``, ``weight_decay`` (the ``adamw_*`` constructor
    arguments are their defaults).

    Muon update per matrix ``W [fan_out, fan_in]`` with gradient ``G`` (EMA momentum form of the
    published algorithm)::

        M = μ·M + (1-μ)·G ;  U = (1-μ)·G + μ·M  if nesterov else M
        O = NS(U)          ;  W = W·(1 - lr·wd) - lr·lr_scale(adjust_lr, W.shape)·O

    Weight decay is decoupled and uses the unscaled ``lr`` (so with ``adjust_lr="rms"`` the
    same ``lr``/``weight_decay`` pair behaves like AdamW's). Matrices with more than two dims
    are flattened to ``[shape[0], -1]``. Same-shaped matrices are orthogonalised together in one
    batched Newton–Schulz call (``ns_method``: ``"auto"`` takes the Gram form, same polynomial
    with fewer FLOPs, for aspect ratios >= 2.5; see :func:`newton_schulz`); FSDP2 DTensor parameters (``Shard(0)``, optionally with
    ``Replicate`` mesh dims) are gathered to an owner rank per matrix (see ``docs/muon.md``),
    tensor-parallel shards orthogonalised as whole matrices. A group with ``stacked=True`` holds
    stacks of matrices ``[S, m, n]`` (MoE experts): each ``[m, n]`` is orthogonalised on its own,
    in the batched local NS with every other matrix of its shape; a rank's shard of a stack
    (FSDP2 ``Shard(0)``, expert parallelism) holds whole matrices, so nothing is gathered.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adjust_lr: str | None = None,
        *,
        ns_coefficients: str | NSSchedule | Sequence[Coefficients] = "jordan",
        backend: Backend = "auto",
        ns_method: Method = "auto",
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        dist_bucket_numel: int = 1 << 25,
    ) -> None:
        if lr < 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid lr={lr} or momentum={momentum}")
        lr_scale(adjust_lr, (1, 1))  # validates the mode
        resolve_schedule(ns_coefficients)
        _use_gram(ns_method, backend, 1, 1)  # validates the method
        self.backend = backend
        self.ns_method = ns_method
        self.dist_bucket_numel = int(dist_bucket_numel)
        muon_defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            weight_decay=weight_decay, adjust_lr=adjust_lr, ns_coefficients=ns_coefficients,
        )  # fmt: skip
        adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
            weight_decay=adamw_weight_decay,
        )  # fmt: skip
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        split: list[dict[str, Any]] = []
        for g in groups:
            g = dict(g)
            ps = list(g.pop("params"))
            if "use_muon" in g:
                split.append({"params": ps, **g})
                continue
            mats, rest = [p for p in ps if p.ndim == 2], [p for p in ps if p.ndim != 2]
            if mats:
                split.append({"params": mats, "use_muon": True, **g})
            if rest:
                split.append({"params": rest, "use_muon": False, **g})
        for g in split:
            for k, v in (muon_defaults if g["use_muon"] else adamw_defaults).items():
                g.setdefault(k, v)
            if g["use_muon"]:
                for p in g["params"]:
                    if p.ndim < 2:
                        raise ValueError(f"Muon needs parameters with ndim >= 2, got {p.shape}")
        super().__init__(split, {})
        self.phase_hook: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ AdamW side
    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            params.append(_local(p))
            grads.append(_local(p.grad))
            exp_avgs.append(_local(st["exp_avg"]))
            exp_avg_sqs.append(_local(st["exp_avg_sq"]))
        if not params:
            return
        # Same arithmetic as torch.optim.AdamW; parameters are batched by their step count.
        by_step: dict[float, list[int]] = defaultdict(list)
        for i, p in enumerate(p for p in group["params"] if p.grad is not None):
            by_step[float(self.state[p]["step"])].append(i)
        for step, idx in by_step.items():
            ps = [params[i] for i in idx]
            gs = [grads[i] for i in idx]
            ms = [exp_avgs[i] for i in idx]
            vs = [exp_avg_sqs[i] for i in idx]
            bc1 = 1 - beta1**step
            bc2_sqrt = math.sqrt(1 - beta2**step)
            if wd != 0:
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, -lr / bc1)

    # ------------------------------------------------------------------ Muon side
    def _momentum(self, group: dict[str, Any], dist: list[tuple], local: list[tuple]) -> None:
        """M = μM + (1-μ)G (one foreach). DTensors sharded over several ranks get their update U
        now (appended to ``dist`` as (p, U, group)); the others (plain tensors, and DTensors held
        whole by this rank) go to ``local`` as (p, G, M, group): their U is written straight into
        the bf16 NS stack (:meth:`_local_step`)."""
        ps, gs, bufs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            ps.append(p)
            gs.append(_local(p.grad))
            bufs.append(_local(st["momentum_buffer"]))
        if not ps:
            return
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, gs, 1 - mu)  # M = μM + (1-μ)G
        if group.get("stacked", False):  # [S, m, n] stacks (MoE experts): S matrices, each whole
            for p, g, b in zip(ps, gs, bufs):  # on this rank (FSDP2/EP shard whole experts)
                w = _local(p)
                local.extend((w[i], g[i], b[i], group) for i in range(w.shape[0]))
            return
        for p, g, b in zip(ps, gs, bufs):
            if _needs_gather(p):
                dist.append((p, g.lerp(b, mu) if group["nesterov"] else b, group))
            else:
                local.append((p, g, b, group))

    def _local_step(self, local: list[tuple]) -> None:
        """Bucket local matrices by (2-D shape, schedule, lr factors); per bucket: write U into
        one bf16 stack in the matrices' own orientation (nesterov lerp and cast in one pass, no
        transpose), one fp32 norm call, batched NS with ``-lr·lr_scale`` folded into the last
        GEMM, then ``W = (1 - lr·wd)·W + O`` in one contiguous pass per matrix."""
        for (r, c, device, ns_key, scale, decay), idx in _buckets(local).items():
            X = torch.empty(len(idx), r, c, device=device, dtype=torch.bfloat16)  # [B, r, c]
            for j, i in enumerate(idx):
                _, g, b, grp = local[i]
                g2, b2 = g.reshape(r, c), b.reshape(r, c)
                if grp["nesterov"]:
                    torch.lerp(g2, b2, grp["momentum"], out=X[j])  # (1-μ)G + μM
                else:
                    X[j].copy_(b2)
            norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float32)  # [B]
            out, fold = self._ns_bucket(X, norm, ns_key, scale)
            for j, i in enumerate(idx):
                lp = _local(local[i][0])
                o = out[j].reshape(lp.shape)
                if not fold:
                    lp.mul_(decay).add_(o, alpha=scale)
                elif decay != 1.0:
                    torch.add(o, lp, alpha=decay, out=lp)  # O + (1 - lr·wd)·W, one pass
                else:
                    lp.add_(o)
            del X, out
            self._mark("apply")

    def _ns_bucket(
        self, X: torch.Tensor, norm: torch.Tensor, ns_key: tuple, scale: float
    ) -> tuple[torch.Tensor, bool]:
        """Batched NS of one bucket's stack ``X [B, r, c]`` (bf16) whose Frobenius norms are
        ``norm [B]`` (fp32, overwritten): ``(O [B, r, c], folded)``, ``O`` times ``scale`` (the
        ``-lr·lr_scale``) where ``folded``. On CUDA the GEMM epilogue is fp32, so folding the lr
        into it costs no precision; the CPU bf16 GEMM rounds before its epilogue, so there the lr
        is applied in fp32 by the caller."""
        steps, schedule = ns_key
        _, r, c = X.shape
        inv = norm.mul_(schedule.norm_scale).add_(1e-7).reciprocal_()  # [B]
        fold = X.is_cuda
        coeffs = schedule.for_steps(steps)
        if _use_gram(self.ns_method, self.backend, r, c):
            self._mark("stack")  # the Frobenius scaling rides in the Gram (no pass over X)
            symmetric = _gram_symmetric(self.backend, X)  # Triton's upper-triangle kernels
            out = _ns_gram(X, coeffs, scale if fold else 1.0, inv_norm=inv, symmetric=symmetric)
        else:
            X.mul_(inv.view(-1, 1, 1))
            self._mark("stack")
            out = _ns_stack(X, coeffs, self.backend, scale if fold else 1.0)  # [B, r, c]
        self._mark("ns")
        return out, fold

    def _orthogonalize(
        self, items: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]
    ) -> list[torch.Tensor]:
        """Orthogonalised local updates (bf16) of sharded DTensor params, for (p, U, group)."""
        from ._distributed import orthogonalize_sharded

        return orthogonalize_sharded(
            [(p, u, _ns_key(g)) for p, u, g in items],
            ns_fn=self._ns,
            bucket_numel=self.dist_bucket_numel,
        )

    def _ns(self, stack: torch.Tensor, key: tuple) -> torch.Tensor:
        steps, schedule = key
        return newton_schulz(
            stack, steps, coefficients=schedule, backend=self.backend, method=self.ns_method
        )

    def _mark(self, phase: str) -> None:
        """Phase boundary: calls ``self.phase_hook(phase)`` if set (the benchmark records CUDA
        events there: adamw, momentum, distributed, then stack / ns / apply per bucket)."""
        if self.phase_hook is not None:
            self.phase_hook(phase)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        self._mark("adamw")
        dist: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        local: list[tuple] = []
        for group in self.param_groups:
            if group["use_muon"]:
                self._momentum(group, dist, local)
        self._mark("momentum")
        if dist:
            for (p, _, g), o in zip(dist, self._orthogonalize(dist)):
                lp = _local(p)
                if g["weight_decay"] != 0:
                    lp.mul_(1 - g["lr"] * g["weight_decay"])
                lp.add_(o.view(lp.shape), alpha=-g["lr"] * lr_scale(g["adjust_lr"], p.shape))
            self._mark("distributed")
        if local:
            self._local_step(local)
        return loss


def _ns_key(group: dict[str, Any]) -> tuple:
    return (int(group["ns_steps"]), resolve_schedule(group["ns_coefficients"]))


def _buckets(local: list[tuple]) -> dict[tuple, list[int]]:
    """Indices of ``local`` ((p, G, M, group) items) by ``(rows, cols, device, ns_key,
    -lr·lr_scale, 1 - lr·wd)``: the matrices that share one stack and one NS call."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, g, _, grp) in enumerate(local):
        r, c = g.size(0), g[0].numel()
        scale = -grp["lr"] * lr_scale(grp["adjust_lr"], p.shape)
        decay = 1.0 - grp["lr"] * grp["weight_decay"]
        buckets[(r, c, g.device, _ns_key(grp), scale, decay)].append(i)
    return buckets
