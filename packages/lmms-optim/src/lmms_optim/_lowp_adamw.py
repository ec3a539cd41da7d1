"""AdamW with bf16 moments (and optionally bf16 weights), rounded stochastically.

Full fine-tuning of a 7B-parameter VL model on one 141 GB GPU does not fit with fp32 AdamW
state: bf16 compute weights (2 B/param) + fp32 masters (4) + the step's bf16 gradient (2) +
fp32 ``exp_avg`` and ``exp_avg_sq`` (4 + 4) is 16 B/param, 133 GB at Qwen2.5-VL-7B's 8.3B
parameters before any activation. Keeping both moments in bf16 saves 4 B/param (12 B/param,
~100 GB); stepping bf16 weights directly without masters saves 4 more (8 B/param).

Why stochastic rounding. bf16 keeps 8 significant bits: an update smaller than half a unit in the
last place (ulp) of the stored value is lost when rounded to nearest. AdamW's second moment moves
by ``(1 - beta2) = 0.1%`` of itself per step, well under bf16's ~0.4% ulp, so a round-to-nearest
``exp_avg_sq`` stalls instead of tracking the gradients; bf16 weights lose every update below
half an ulp of the weight, which late in training is most of them. Stochastic rounding rounds up
with probability equal to the discarded fraction, so the stored value is right *in expectation*
and small updates accumulate over steps.

Rounding scheme (:func:`stochastic_round_`): the fp32 value's 32 bits as an integer, plus a
uniform random integer in ``[0, 2^16)``, then the low 16 bits cleared; the result is exactly
representable in bf16. Adding to the bit pattern rounds the magnitude up (away from zero) with
probability (discarded low bits) / 2^16, for either sign, so ``E[round(x)] = x`` for every finite
``x`` that is not above bf16's largest finite value. Infinities and NaNs stay what they are.

Determinism: the random integers come from a ``torch.Generator`` on the parameter's device seeded
with a hash of (``seed``, the step number, the parameter's index in the optimizer, the state
tensor, the chunk), so a run and its resume from a checkpoint (the step counts live in the state)
round identically; the same seed on another device type draws other integers.

All arithmetic is fp32: each step reads the bf16 moments (and weights), updates them in fp32 like
``torch.optim.AdamW`` (decoupled weight decay, bias correction), and rounds the results back.
Backends: ``"torch"`` (any device: large parameters go in chunks of ``chunk_numel`` elements,
which bounds the fp32 temporaries; several passes per chunk) and ``"triton"`` (one kernel per
parameter reading and writing each tensor once, Philox draws in the kernel: ``_lowp_triton``;
CUDA, or CPU under ``TRITON_INTERPRET=1``); ``"auto"`` takes Triton on CUDA. The two draw from
different generators: each is deterministic for a seed, they agree in distribution only.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._common import closure_loss
from ._flat_adamw import Hyper

__all__ = ["LowPrecisionAdamW", "stochastic_round_"]

_LOW = 1 << 16  # the 16 bits of an fp32 value that bf16 does not keep


def stochastic_round_(
    out: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Write fp32 ``x`` into bf16 ``out`` (same shape) rounded stochastically (module doc)."""
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16 or out.shape != x.shape:
        raise ValueError(
            f"stochastic_round_: fp32 input and a bf16 output of its shape; got {x.dtype} "
            f"{tuple(x.shape)} -> {out.dtype} {tuple(out.shape)}"
        )
    noise = torch.randint(
        0, _LOW, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )  # [x.shape] uniform in [0, 2^16)
    bits = x.contiguous().view(torch.int32)
    finite = torch.isfinite(x)
    rounded = torch.bitwise_and(bits + noise, -_LOW)  # low 16 bits cleared: exact in bf16
    rounded = torch.where(finite, rounded, bits)  # inf / nan: unchanged
    out.copy_(rounded.view(torch.float32))
    return out


def _hyper(group: dict[str, Any], step: int) -> Hyper:
    """A parameter group's AdamW hyper-parameters at ``step`` (counted after its increment)."""
    b1, b2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    return Hyper(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step)


def _seed(seed: int, step: int, index: int, what: int, chunk: int) -> int:
    """A 63-bit generator seed from the draw's coordinates (stable across processes)."""
    data = f"{seed}:{step}:{index}:{what}:{chunk}".encode()
    return (zlib.crc32(data) << 31) ^ zlib.crc32(data[::-1]) ^ (step * 0x9E3779B1)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW keeping ``exp_avg`` and ``exp_avg_sq`` in ``state_dtype`` (bf16), rounded
    stochastically; bf16 parameters are updated in fp32 and rounded the same way (module doc).

    ``rounding``: ``"stochastic"`` (default) or ``"nearest"`` (plain ``.to(bf16)``; for the
    convergence comparison, not for training). ``seed`` fixes the rounding draws (resume-exact).
    ``state_dtype=torch.float32`` keeps fp32 moments (then only bf16 weights are rounded).

    Like lmms-optim's master-weight optimizers it takes a clip scale and a gradient source:
    :meth:`clip_norm_` measures the gradients and sets a device-side ``min(1, max/(norm+1e-6))``
    that the step applies (no host read, no pass over the gradients), and
    :meth:`set_grad_source` lets ``lmms_parallel.MasterWeights`` hand over a single micro-batch's
    bf16 gradient instead of an fp32 copy (2 B/param instead of 4).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        rounding: str = "stochastic",
        seed: int = 0,
        chunk_numel: int = 1 << 24,
        backend: str = "auto",
        fused: bool = True,
    ) -> None:
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"state_dtype must be torch.bfloat16 or torch.float32, got {state_dtype}"
            )
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(
                        f"LowPrecisionAdamW steps fp32 or bf16 parameters, got {p.dtype}"
                    )
        self.state_dtype, self.rounding, self.seed = state_dtype, rounding, seed
        self.chunk_numel, self.backend, self.fused = chunk_numel, backend, fused
        self.clip_scale: torch.Tensor | None = None
        self._grad_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p.grad
        self._mirrors: dict[int, torch.Tensor] = {}
        self._packs: dict[tuple[int, ...], Any] = {}  # ids of a group's stepped params -> tables

    def set_mirrors(self, mirrors: dict[int, torch.Tensor]) -> None:
        """``id(parameter) -> tensor`` of its shape (bf16 compute weights) that receives the
        parameter's new value after each step: in the update's own kernel on the fused Triton
        path, one copy per parameter otherwise (``lmms_parallel.MasterWeights.attach`` hands
        over the compute weights and then runs no copy of its own)."""
        stepped = [p for g in self.param_groups for p in g["params"]]
        for p in stepped:
            m = mirrors.get(id(p))
            if m is None or m.shape != p.shape or m.device != p.device or not m.is_contiguous():
                raise ValueError(
                    "LowPrecisionAdamW.set_mirrors: every parameter needs a contiguous mirror of "
                    f"its shape and device (parameter {tuple(p.shape)} on {p.device})"
                )
        self._mirrors = {id(p): mirrors[id(p)] for p in stepped}
        self._packs.clear()

    # ------------------------------------------------------------------ gradients
    def set_grad_source(self, grad_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Read each parameter's gradient as ``grad_of(p)`` (any float dtype) instead of
        ``p.grad``."""
        self._grad_of = grad_of

    def gradients(self) -> list[torch.Tensor]:
        grads = (self._grad_of(p) for g in self.param_groups for p in g["params"])
        return [g for g in grads if g is not None]

    def clip_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradients (fp32 accumulation) as a device tensor; with
        ``max_norm > 0`` the next step scales them by ``min(1, max_norm / (norm + 1e-6))``."""
        grads = self.gradients()
        if not grads:
            return torch.zeros((), device=self.param_groups[0]["params"][0].device)
        from ._master_adamw import _norms_fp32  # one foreach launch per dtype

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        norms = [n for gs in by_dtype.values() for n in _norms_fp32(gs)]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        if max_norm > 0:
            self.clip_scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return norm

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts floating state to each parameter's dtype; the moments go back to
        ``state_dtype`` (bf16 -> fp32 -> bf16 is exact) and the step counts stay on the host."""
        super().load_state_dict(state_dict)
        self._packs.clear()  # new state tensors: the fused path's address tables are stale
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)
            if "step" in state:
                state["step"] = state["step"].detach().to("cpu", torch.float32)

    # ------------------------------------------------------------------ rounding
    def _store(self, out: torch.Tensor, x: torch.Tensor, coords: tuple[int, int, int, int]) -> None:
        """Write fp32 ``x`` into ``out`` (its dtype), rounding to bf16 as configured."""
        if out.dtype == torch.float32:
            out.copy_(x)
        elif self.rounding == "nearest":
            out.copy_(x)  # .to(bf16): round to nearest even
        else:
            gen = torch.Generator(device=x.device)
            gen.manual_seed(_seed(self.seed, *coords) % (1 << 63))
            stochastic_round_(out, x, gen)

    def _use_triton(self, p: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        import os

        usable = p.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        try:
            import triton  # noqa: F401
        except ImportError:
            usable = False
        if self.backend == "triton" and not usable:
            raise RuntimeError(
                "LowPrecisionAdamW backend='triton' needs triton and CUDA tensors (or "
                "TRITON_INTERPRET=1 on CPU); use backend='torch'"
            )
        return usable and (self.backend == "triton" or p.is_cuda)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        scale = self.clip_scale
        first = 0  # optimizer-wide index of the group's first parameter (the rounding seeds)
        for group in self.param_groups:
            if not (self.fused and self._fused_group(group, first, scale)):
                for k, p in enumerate(group["params"]):
                    self._step_param(group, p, first + k, scale)
            first += len(group["params"])
        self.clip_scale = None
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    def _fused_group(self, group: dict[str, Any], first: int, scale: torch.Tensor | None) -> bool:
        """Every parameter of ``group`` with a gradient in one Triton launch
        (:mod:`lmms_optim._lowp_multi`); False (nothing done) where that path does not apply:
        not the Triton backend, mixed dtypes, non-contiguous tensors, unequal step counts."""
        from ._muon import _local  # FSDP2's DTensors: their local shards (shared storage)

        live = [(first + k, p, self._grad_of(p)) for k, p in enumerate(group["params"])]
        live = [(i, p, _local(g)) for i, p, g in live if g is not None]
        if not live or not self._use_triton(live[0][1]):
            return False
        if len({p.dtype for _, p, _ in live}) != 1 or len({g.dtype for _, _, g in live}) != 1:
            return False
        if not all(_local(p).is_contiguous() and g.is_contiguous() for _, p, g in live):
            return False
        states = [self._state(p) for _, p, _ in live]
        steps = {float(st["step"]) for st in states}
        if len(steps) != 1:
            return False
        torch._foreach_add_([st["step"] for st in states], 1.0)
        t = int(steps.pop()) + 1
        from ._lowp_multi import MultiPack, lowp_adamw_multi_

        key = tuple(id(p) for _, p, _ in live)
        pack = self._packs.get(key)
        if pack is None:
            mirrors = [self._mirrors[id(p)] for _, p, _ in live] if self._mirrors else None
            pack = self._packs[key] = MultiPack(
                [_local(p) for _, p, _ in live], [_local(st["exp_avg"]) for st in states],
                [_local(st["exp_avg_sq"]) for st in states], mirrors,
            )  # fmt: skip
        lowp_adamw_multi_(
            pack, [g for _, _, g in live], [_seed(self.seed, t, i, 0, 0) % (1 << 31) for i, _, _ in live],
            _hyper(group, t), stochastic=self.rounding == "stochastic", grad_scale=scale,
        )  # fmt: skip
        return True

    def _step_param(
        self, group: dict[str, Any], p: torch.Tensor, index: int, scale: torch.Tensor | None
    ) -> None:
        """One parameter's step: the per-parameter Triton kernel or the torch path, then its
        mirror's copy (if any)."""
        grad = self._grad_of(p)
        if grad is None:
            return
        state = self._state(p)
        state["step"] += 1
        t = int(state["step"].item())  # a host counter (CPU tensor): no device read
        hp = _hyper(group, t)
        if self._use_triton(p):
            from ._lowp_triton import lowp_adamw_triton_

            lowp_adamw_triton_(
                p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], hp,
                seed=_seed(self.seed, t, index, 0, 0) % (1 << 31),
                stochastic=self.rounding == "stochastic", grad_scale=scale,
            )  # fmt: skip
        else:
            self._step_torch(p, grad, state, hp, index, scale)
        if id(p) in self._mirrors:
            self._mirrors[id(p)].copy_(p)

    def _step_torch(self, p, grad, state, hp: Hyper, index, scale) -> None:
        """The torch backend: fp32 arithmetic in chunks of ``chunk_numel``, rounded back."""
        lr, b1, b2, eps, wd, t = hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.step
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        step_size, bc2_sqrt = lr / bc1, math.sqrt(bc2)
        flat = (p.view(-1), grad.reshape(-1), state["exp_avg"].view(-1),
                state["exp_avg_sq"].view(-1))  # fmt: skip
        for c, start in enumerate(range(0, p.numel(), self.chunk_numel)):
            pc, gc, mc, vc = (x[start : start + self.chunk_numel] for x in flat)
            g = gc.float()
            if scale is not None:
                g = g * scale
            m, v = mc.float(), vc.float()
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            w = pc.float() if pc.dtype != torch.float32 else pc
            if wd:
                w.mul_(1 - lr * wd)
            w.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)  # torch's order
            if pc.dtype != torch.float32:
                self._store(pc, w, (t, index, 0, c))
            self._store(mc, m, (t, index, 1, c))
            self._store(vc, v, (t, index, 2, c))
