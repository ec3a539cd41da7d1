"""Mixed precision on one device without FSDP2: bf16 weights for compute, fp32 masters to train.

FSDP2 on a one-rank mesh gives the same arithmetic (bf16 compute weights cast from fp32 masters,
gradients reduced into fp32), but pays for it in copies: every step it casts each weight into its
all-gather buffer, "gathers" it (a memcpy) and copies it out, twice when blocks reshard after
forward, then copies every gradient in for the fp32 reduction: ~45 ms of a 621 ms Qwen2.5-3B step
on an H200 (benchmarks/models/NOTES.md, lever 17). `MasterWeights` keeps what those copies are
for and drops the copies:

- the trainable parameters are cast to the compute dtype in place, as views into one flat buffer;
  their fp32 values move to `masters` (views into one flat fp32 buffer), which the optimizer steps;
- each gradient is added into its master's fp32 gradient as soon as autograd has accumulated it
  (a post-accumulate-grad hook) and freed at once, so gradient accumulation over micro-batches is
  in fp32, as with FSDP2's fp32 reduction, and no step holds low-precision and fp32 gradients of
  every weight at the same time;
- after each optimizer step the masters are written back into the compute weights with one copy
  (`attach` registers it as the optimizer's step post-hook).

Frozen parameters are cast to the compute dtype too (FSDP2 computes with them in that dtype; they
are never updated, so they need no master). Buffers keep their dtype (FSDP2 does not cast them
either), so rotary frequencies and the like stay fp32.

Checkpoints and exports go through `state_module()`: a module with the model's parameter and
buffer names whose trainable parameters are the masters, so DCP keys the optimizer state by the
same names as on the FSDP2 path and either path resumes the other's checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["MasterWeights"]

_ALIGN = 64  # elements: every view starts 128-byte aligned in bf16 (256 in fp32)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class MasterWeights:
    """fp32 master weights for a module computing in `dtype` (bf16), on one device.

    Args:
        model: built in fp32 (the masters are its values, bit for bit); its parameters are
            replaced in place by `dtype` views, so build it, freeze what stays frozen and apply
            kernels, checkpointing and `torch.compile` first, then wrap.
        dtype: the compute dtype.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        params = dict(model.named_parameters())
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        if not trainable:
            raise ValueError("MasterWeights: the model has no trainable parameter")
        devices = {p.device for p in params.values()}
        if len(devices) != 1:
            raise ValueError(
                f"MasterWeights: parameters on several devices: {sorted(map(str, devices))}"
            )
        if any(not p.is_floating_point() for p in trainable.values()):
            raise ValueError("MasterWeights: trainable parameters must be floating point")
        (device,) = devices
        self.model = model
        offsets, total = {}, 0
        for name, p in trainable.items():
            offsets[name] = total
            total += _aligned(p.numel())
        self._flat_model = torch.empty(total, dtype=dtype, device=device)
        self._flat_master = torch.zeros(total, dtype=torch.float32, device=device)
        self.masters: dict[str, nn.Parameter] = {}
        self._master_of: dict[int, nn.Parameter] = {}  # id(compute weight) -> its master
        self._compute_of: dict[int, torch.Tensor] = {}  # id(master) -> its compute weight
        with torch.no_grad():
            for name, p in trainable.items():
                a, b = offsets[name], offsets[name] + p.numel()
                master = self._flat_master[a:b].view(p.shape)
                master.copy_(p)
                compute = self._flat_model[a:b].view(p.shape)
                compute.copy_(master)
                p.data = compute
                self.masters[name] = self._master_of[id(p)] = nn.Parameter(master)
                self._compute_of[id(self.masters[name])] = compute
                p.register_post_accumulate_grad_hook(self._to_master(self.masters[name]))
            for p in params.values():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(dtype)
        self._mirror: nn.Module | None = None
        # id(master) -> the bf16 gradient of a step's first micro-batch, kept as it is when the
        # optimizer reads gradients through `gradient` (`defer_cast`, see `attach`)
        self._pending: dict[int, torch.Tensor] = {}
        self._defer = False

    def _to_master(self, master: nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None
            if master.grad is not None:
                master.grad.add_(g)
                return
            first = self._pending.pop(id(master), None)
            if first is None and self._defer:  # exact in bf16: the fp32 cast can wait
                self._pending[id(master)] = g
                return
            master.grad = (g if first is None else first).to(torch.float32)
            if first is not None:  # a second micro-batch: accumulate in fp32 from here on
                master.grad.add_(g)

        return hook

    def gradient(self, master: torch.Tensor) -> torch.Tensor | None:
        """`master`'s gradient: its fp32 `.grad`, or the bf16 gradient of a single micro-batch
        not cast yet (`defer_cast`); None if it has none this step."""
        return master.grad if master.grad is not None else self._pending.get(id(master))

    def parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 masters: what the optimizer steps and gradient clipping measures."""
        return iter(self.masters.values())

    def map_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """`params` of the model with each trainable one replaced by its master (to build
        optimizer parameter groups from the model's names and modules)."""
        return [self._master_of.get(id(p), p) for p in params]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the masters into the compute weights (one copy kernel)."""
        self._flat_model.copy_(self._flat_master)

    def attach(self, optimizer: torch.optim.Optimizer, *, defer_cast: bool | None = None) -> None:
        """Write back after every `optimizer.step()`; the optimizer must step the masters.

        An optimizer with `set_mirrors` (`lmms_optim.MasterAdamW`) gets each master's compute
        weight and writes it in its own update; otherwise one copy of the flat buffer runs as the
        optimizer's step post-hook. One with `set_grad_source` too reads gradients through
        `gradient`: with `defer_cast` (default: on CUDA) a step of one micro-batch keeps each
        bf16 gradient as it is (the fp32 cast is exact, so the optimizer's kernel reads bf16
        instead of a copy twice its size); a second micro-batch casts and accumulates in fp32."""
        mine = {id(m) for m in self.masters.values()}
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not stepped <= mine:
            raise ValueError(
                "MasterWeights.attach: the optimizer steps tensors that are not masters"
            )
        if hasattr(optimizer, "set_mirrors"):
            optimizer.set_mirrors(self._compute_of)
        else:
            optimizer.register_step_post_hook(lambda *_: self.copy_to_model())
        if hasattr(optimizer, "set_grad_source"):
            on_cuda = self._flat_master.is_cuda
            self._defer = on_cuda if defer_cast is None else defer_cast
            optimizer.set_grad_source(self.gradient)
            optimizer.register_step_post_hook(lambda *_: self._pending.clear())

    def state_module(self) -> nn.Module:
        """A module with the model's state-dict names: the masters where the model trains, its
        frozen parameters and persistent buffers elsewhere. Hand it (not the model) to
        checkpointing and export; after loading into it, call `copy_to_model()`."""
        if self._mirror is None:
            self._mirror = _mirror(self.model, self._master_of)
        return self._mirror


def _mirror(model: nn.Module, replace: dict[int, nn.Parameter]) -> nn.Module:
    root = nn.Module()

    def owner(path: str) -> tuple[nn.Module, str]:
        *parents, leaf = path.split(".")
        mod = root
        for part in parents:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        return mod, leaf

    for name, p in model.named_parameters(remove_duplicate=False):
        mod, leaf = owner(name)
        mod.register_parameter(leaf, replace.get(id(p), p))
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for leaf, b in mod._buffers.items():
            if b is not None and leaf not in mod._non_persistent_buffers_set:
                target, _ = owner(f"{mod_name}.{leaf}" if mod_name else leaf)
                target.register_buffer(leaf, b)
    return root
