"""Muon over fp32 master weights whose step also clips and writes the low-precision weights.

:class:`MasterAdamW`'s counterpart for ``optimizer: muon``. Around its Newton–Schulz, a one-GPU
bf16 step of :class:`Muon` with ``lmms_parallel.MasterWeights`` makes these passes over every
Muon matrix: the clip multiply of the fp32 gradient (``clip_grad_norm_``), the momentum lerp,
the nesterov lerp and bf16 cast into the NS stack, the Frobenius norm of the stack, the apply
``W = decay·W + O`` and the copy of the masters into the bf16 model (plus the fp32 cast of every
bf16 gradient in MasterWeights' hook). :class:`MasterMuon` makes two per matrix
(``lmms_optim._muon_kernels``):

- before NS, one kernel reads ``G`` (bf16 or fp32) times ``clip_scale`` and ``M``, writes ``M``
  and the bf16 NS input straight into the bucket's stack, and per-program sums of squares of it
  (the norm, summed by torch: deterministic);
- after NS (unchanged: the batched ``_ns_gram`` / ``_ns_stack`` of :class:`Muon`, lr folded as
  there), one kernel applies ``W = decay·W + O`` to the fp32 master and writes its bf16 mirror.

Bytes per Muon parameter (fp32 master, bf16 gradient from the source): 2 (clip norm), then
2 + 4 + 4 + 2 before NS and 2 (read O) + 4 + 4 + 2 after it: 26 B, against 6 (fp32 grad cast) +
4 + 8 (clip norm and multiply) + 12 (lerp) + 10 (nesterov) + 2 (norm) + 10 (apply) + 6 (copy) =
58 B on the three-pass step: 32 B less per parameter, ~120 GB for 3.75 B Muon parameters (~40 ms
at ~3 TB/s; an estimate, not measured yet).

The AdamW side takes :class:`MasterAdamW`'s path (:class:`MasterStep`). State, parameter groups
and checkpoints are :class:`Muon`'s (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``),
so either optimizer resumes the other. Without CUDA and Triton, with ``backend="torch"``, or when
a parameter is a DTensor sharded over several ranks, ``step`` multiplies the gradients by the
scale, runs :meth:`Muon.step` and copies the mirrors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._master_adamw import MasterStep
from ._muon import Muon, _buckets, _local, _needs_gather
from ._muon_kernels import apply_, momentum_stack_, n_partials

__all__ = ["MasterMuon"]


class MasterMuon(MasterStep, Muon):
    """:class:`Muon` with the gradient-clip multiply and a bf16 write-back in its step.

    Takes :class:`Muon`'s arguments. ``backend``: ``"auto"`` (the fused kernels on CUDA when
    Triton imports, Newton–Schulz as :class:`Muon` picks it), ``"triton"`` (the fused kernels
    and Triton NS; CPU only under ``TRITON_INTERPRET=1``) or ``"torch"`` (:class:`Muon`'s step).

    As :class:`MasterAdamW`: set :attr:`clip_scale` (0-d fp32 device tensor, consumed by the
    step) or call :meth:`clip_norm_`; :meth:`set_grad_source` may hand over bf16 gradients;
    :meth:`set_mirrors` gives each parameter the tensor written from its new value every step.
    """

    def __init__(self, params: Any, *args: Any, backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(params, *args, backend=backend, **kwargs)  # type: ignore[arg-type]
        self._init_master(backend)

    def set_mirrors(self, mirrors: dict[int, torch.Tensor]) -> None:
        """As :meth:`MasterAdamW.set_mirrors`; refused for parameters sharded over several ranks
        (their full value is never on one rank: mirrors are for one-device master weights)."""
        params = (p for g in self.param_groups for p in g["params"])
        sharded = [tuple(p.shape) for p in params if _needs_gather(p)]
        if sharded:
            raise NotImplementedError(
                f"MasterMuon.set_mirrors: parameters {sharded[:4]} are sharded over several "
                "ranks; mirrors are for one-device master weights (lmms_parallel.MasterWeights)"
            )
        super().set_mirrors(mirrors)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss, scale, params = self._start_step(closure)
        stacked = any(g.get("stacked", False) for g in self.param_groups)  # Muon's own path
        if stacked or not self._use_triton(params) or any(_needs_gather(p) for p in params):
            self._torch_step(params, scale, super().step)
            return loss
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_triton_group(group, scale)
        self._mark("adamw")
        local: list[tuple] = []
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                g = self._grad_of(p)
                if g is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                local.append((p, _local(g), _local(st["momentum_buffer"]), group))
        self._mark("momentum")
        if local:
            self._fused_local_step(local, scale)
        return loss

    def _fused_local_step(self, local: list[tuple], scale: torch.Tensor | None) -> None:
        """Per bucket of same-shaped matrices (:class:`Muon`'s buckets): one momentum kernel per
        matrix into the bf16 stack, the norms from its partial sums, Muon's batched NS, then one
        apply kernel per matrix writing the master and its mirror."""
        for (r, c, device, ns_key, lr_scale_, decay), idx in _buckets(local).items():
            X = torch.empty(len(idx), r, c, device=device, dtype=torch.bfloat16)  # [B, r, c]
            partials = torch.empty(len(idx), n_partials(r * c), device=device)  # [B, P]
            for j, i in enumerate(idx):
                _, g, m, grp = local[i]
                momentum_stack_(
                    g.reshape(-1), m.view(-1), X[j].view(-1), partials[j], scale,
                    momentum=grp["momentum"], nesterov=grp["nesterov"],
                )  # fmt: skip
            norm = partials.sum(dim=1).sqrt_()  # [B]
            out, folded = self._ns_bucket(X, norm, ns_key, lr_scale_)
            del X
            for j, i in enumerate(idx):
                p = _local(local[i][0])
                mirror = self._mirrors.get(id(local[i][0]))
                bf16 = mirror is not None and mirror.dtype == torch.bfloat16
                apply_(
                    p.view(-1), out[j].reshape(-1), _local(mirror).view(-1) if bf16 else None,
                    decay=decay, scale=lr_scale_, folded=folded,
                )  # fmt: skip
                if mirror is not None and not bf16:  # another dtype: one copy
                    mirror.copy_(p)
            del out
            self._mark("apply")
