"""AdamW over fp32 master weights whose step also clips and writes the low-precision weights.

A one-device bf16 run (lmms-parallel's ``MasterWeights``) ends each step with three passes over
every trainable parameter besides AdamW's own: the clip multiply of the fp32 gradients, the
update, and the copy of the updated masters into the bf16 compute weights. On a Qwen2.5-3B text
step on an H200 those are 6.8 + 25.3 + ~5 ms of a device-bound 581 ms step
(benchmarks/models/NOTES.md, item 26). :class:`MasterAdamW` does the three in one kernel per
weight matrix (:func:`lmms_optim.flat_adamw_`): the gradient is multiplied by ``clip_scale`` (a
device scalar, so clipping needs no host read), the master, ``exp_avg`` and ``exp_avg_sq`` are
updated and the bf16 mirror is written from the new master. Parameters under ``small_numel``
elements (norms, biases) go through torch's fused AdamW and one copy together, since a launch
each would cost more than their bytes. The gradient may be a lower-precision tensor handed over
by :meth:`set_grad_source` (one micro-batch's bf16 gradient, exact in fp32).

It *is* a ``torch.optim.AdamW`` (same parameter groups, same state: ``step``, ``exp_avg``,
``exp_avg_sq`` per parameter, ``step`` a float32 device tensor as with ``fused=True``), so
checkpoints, DCP and learning-rate schedulers see no difference and either optimizer resumes the
other's state. Without CUDA and Triton (or with ``backend="torch"``) ``step`` applies the scale
with one ``_foreach_mul_``, runs ``torch.optim.AdamW``'s own step and copies the mirrors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._common import closure_loss
from ._flat_adamw import Flat, Hyper, _step_triton, flat_adamw_, segment_chunks
from ._muon import _local

__all__ = ["MasterAdamW", "MasterStep"]

_BLOCK = 8192  # elements per chunk of one parameter (the kernel's work per program)


class MasterStep:
    """What :class:`MasterAdamW` and ``MasterMuon`` share: the clip scale, the gradient source,
    the low-precision mirrors, the global norm, and the AdamW update of their AdamW parameters
    on the Triton path (:func:`flat_adamw_` for big parameters, torch's fused AdamW for small
    ones). Mixed into a ``torch.optim.Optimizer`` whose AdamW groups carry ``lr``, ``betas``,
    ``eps`` and ``weight_decay``; ``_init_master`` sets its attributes."""

    param_groups: list[dict[str, Any]]
    state: Any
    backend: str

    def _init_master(self, backend: str) -> None:
        if backend not in ("auto", "triton", "torch"):
            name = type(self).__name__
            raise ValueError(
                f"{name}: backend must be 'auto', 'triton' or 'torch', got {backend!r}"
            )
        self.clip_scale: torch.Tensor | None = None
        self._mirrors: dict[int, torch.Tensor] = {}
        self._chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._host_steps: dict[int, int] = {}  # id(param) -> its step count, kept on the host
        self._checked: dict[int, torch.dtype] = {}  # id(param) -> grad dtype flat_adamw_ checked
        self._grad_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p.grad
        # parameters below this many elements share a few foreach launches (`_small_group`)
        self.small_numel = 1 << 16

    # ------------------------------------------------------------------ set-up
    def set_mirrors(self, mirrors: dict[int, torch.Tensor]) -> None:
        """``id(parameter) -> tensor`` of the same shape (any float dtype) written after each
        step; every stepped parameter needs one (a partial map would leave weights stale)."""
        name = type(self).__name__
        stepped = [p for g in self.param_groups for p in g["params"]]
        missing = [tuple(p.shape) for p in stepped if id(p) not in mirrors]
        if missing:
            raise ValueError(f"{name}.set_mirrors: no mirror for parameters {missing[:4]}")
        for p in stepped:
            m = mirrors[id(p)]
            if m.shape != p.shape or m.device != p.device or not m.is_contiguous():
                raise ValueError(
                    f"{name}.set_mirrors: a mirror must be a contiguous tensor of the "
                    f"parameter's shape and device; got {tuple(m.shape)} on {m.device} for "
                    f"{tuple(p.shape)} on {p.device}"
                )
        self._mirrors = {id(p): mirrors[id(p)] for p in stepped}

    def set_grad_source(self, grad_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Where each parameter's gradient is: ``grad_of(p)`` instead of ``p.grad``. It may be
        of a lower precision than ``p`` (e.g. the bf16 gradient of a single micro-batch, which
        the fp32 master would hold exactly): the kernel reads it as it is, the torch path casts."""
        self._grad_of = grad_of

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the next :meth:`step` uses (those that exist)."""
        grads = (self._grad_of(p) for g in self.param_groups for p in g["params"])
        return [g for g in grads if g is not None]

    def clip_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of :meth:`gradients` (fp32 accumulation whatever their dtype), as
        a device tensor (zero when no parameter has a gradient); with ``max_norm > 0`` sets
        :attr:`clip_scale` to ``torch.nn.utils.clip_grad_norm_``'s coefficient
        ``min(1, max_norm / (norm + 1e-6))``. Nothing is read on the host and no gradient is
        rewritten."""
        grads = self.gradients()
        if not grads:
            return torch.zeros((), device=self.param_groups[0]["params"][0].device)
        if all(g.dtype == torch.float32 for g in grads):
            norm = torch.nn.utils.get_total_norm(grads)  # what clip_grad_norm_ computes
        else:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            norms = [n for gs in by_dtype.values() for n in _norms_fp32(gs)]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        if hasattr(norm, "full_tensor"):  # DTensor gradients (FSDP2): all-reduced on the device
            norm = norm.full_tensor()
        if max_norm > 0:
            self.clip_scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return norm

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._host_steps.clear()  # re-read from the loaded ``step`` tensors at the next step

    def _use_triton(self, params: list[torch.Tensor]) -> bool:
        if self.backend == "torch" or not params:
            return False
        on_cuda = all(p.is_cuda for p in params)
        if self.backend == "triton":
            return True  # flat_adamw_ raises a clear error where it cannot run
        if not on_cuda:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    def _start_step(
        self, closure: Callable[[], float] | None
    ) -> tuple[float | None, torch.Tensor | None, list[torch.Tensor]]:
        """The closure's loss, the clip scale (consumed) and the parameters with a gradient."""
        loss = closure_loss(closure)
        scale, self.clip_scale = self.clip_scale, None
        grads = ((p, self._grad_of(p)) for g in self.param_groups for p in g["params"])
        return loss, scale, [p for p, g in grads if g is not None]

    def _torch_step(
        self, params: list[torch.Tensor], scale: torch.Tensor | None, step: Callable[[], Any]
    ) -> None:
        """The plain path: gradients from the source cast to the parameter's dtype (exact), the
        clip multiply, the base optimizer's own ``step`` and one copy into the mirrors."""
        for p in params:  # a lower-precision gradient from the source: cast, exactly
            if p.grad is None:
                p.grad = self._grad_of(p).to(p.dtype)  # type: ignore[union-attr]
        if scale is not None and params:
            torch._foreach_mul_([_local(p.grad) for p in params], scale)
        step()
        if self._mirrors and params:
            torch._foreach_copy_([self._mirrors[id(p)] for p in params], params)

    def _adamw_triton_group(self, group: dict[str, Any], scale: torch.Tensor | None) -> None:
        grads = {id(p): self._grad_of(p) for p in group["params"]}
        params = [p for p in group["params"] if grads[id(p)] is not None]
        for p in params:
            state = self.state[p]
            if not state:  # as torch's fused AdamW: step a float32 tensor on the device
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self._host_steps[id(p)] = 0
        loaded = [p for p in params if id(p) not in self._host_steps]
        if loaded:  # state from load_state_dict: one host read for all, then counted here
            steps = torch.stack([self.state[p]["step"].float().cpu() for p in loaded]).tolist()
            self._host_steps.update((id(p), int(n)) for p, n in zip(loaded, steps, strict=True))
            for p in loaded:  # load_state_dict keeps ``step`` on the host; the fused kernels
                state = self.state[p]  # want it beside the parameter
                state["step"] = state["step"].to(p.device, torch.float32)
        if params:
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
        beta1, beta2 = group["betas"]
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"])
        hyper["weight_decay"] = group["weight_decay"]
        small = [p for p in params if p.numel() < self.small_numel]
        if small:
            self._small_group(small, [grads[id(p)] for p in small], scale, hyper)
        for p in params:
            if p.numel() < self.small_numel:
                continue
            state = self.state[p]
            step = self._host_steps[id(p)] = self._host_steps[id(p)] + 1
            chunks = self._chunks.get(id(p))
            if chunks is None:
                chunks = self._chunks[id(p)] = segment_chunks([(0, p.numel())], _BLOCK, p.device)
            mirror = self._mirrors.get(id(p))
            out = None if mirror is None else mirror.view(-1)
            grad = grads[id(p)]
            # written tensors must be views (view raises otherwise); the gradient is only read
            args = (p.view(-1), grad.reshape(-1), state["exp_avg"].view(-1))
            args += (state["exp_avg_sq"].view(-1), chunks)
            if self._checked.get(id(p)) == grad.dtype:  # checked once: skip the host checks
                _step_triton(Flat(*args, scale, out), Hyper(step=step, **hyper))
            else:
                flat_adamw_(*args, grad_scale=scale, out=out, backend="triton", step=step, **hyper)
                self._checked[id(p)] = grad.dtype

    def _small_group(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        scale: torch.Tensor | None,
        hyper: dict[str, float],
    ) -> None:
        """Norm weights, biases and other small parameters in a few foreach launches (torch's
        fused AdamW) instead of one kernel each: their launch would cost more than their bytes."""
        for p in params:
            self._host_steps[id(p)] += 1
        grads = [g.to(p.dtype) for g, p in zip(grads, params, strict=True)]
        if scale is not None:
            grads = torch._foreach_mul(grads, scale)
        states = [self.state[p] for p in params]
        torch._fused_adamw_(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
            [s["step"] for s in states], lr=hyper["lr"], beta1=hyper["beta1"],
            beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
            amsgrad=False, maximize=False,
        )  # fmt: skip
        mirrors = [self._mirrors[id(p)] for p in params if id(p) in self._mirrors]
        if mirrors:
            torch._foreach_copy_(mirrors, [p for p in params if id(p) in self._mirrors])


class MasterAdamW(MasterStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the gradient-clip multiply and a bf16 write-back in its step.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (no amsgrad, maximize,
            capturable or differentiable: the kernel implements the plain update).
        backend: ``"auto"`` (the Triton kernel on CUDA when Triton imports, torch's AdamW
            otherwise), ``"triton"`` or ``"torch"``.

    Before each :meth:`step`, set :attr:`clip_scale` to a 0-d fp32 device tensor (the clip
    coefficient, <= 1) or leave it ``None``; the step multiplies every gradient by it (the
    Triton path without touching the gradient) and clears it. :meth:`set_mirrors` gives each
    stepped parameter a low-precision tensor that receives its new value after every step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._init_master(backend)
        self.backend = backend

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss, scale, params = self._start_step(closure)
        if self._use_triton(params):
            for group in self.param_groups:
                self._adamw_triton_group(group, scale)
        else:
            self._torch_step(params, scale, super().step)
        return loss


def _norms_fp32(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms accumulated in fp32 (one foreach call where torch has its dtype)."""
    try:
        return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    except TypeError:  # a torch without the dtype argument
        return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
