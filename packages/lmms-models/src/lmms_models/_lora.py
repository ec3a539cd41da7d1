"""LoRA adapters on any family, built on peft's LoRA layers (``pip install lmms-models[lora]``).

:func:`apply_lora` injects peft's ``lora.Linear`` around the chosen ``nn.Linear`` modules of the
towers a family declares (:meth:`lmms_models.ModelSpec.towers`), in place, so every spec hook
(``text_model``, ``decoder_blocks``, ``lm_head``...) still finds its modules and FSDP2 / activation
checkpointing wrap the same blocks. Each tower is ``lora`` (adapters on its linear layers, base
frozen), ``frozen`` or ``full`` (trained whole); everything outside the towers (embeddings, LM
head, projectors) is frozen unless named in ``train``.

Why peft's layers rather than our own: they are the format users load (``PeftModel``), their
merge/unmerge, dropout, rsLoRA and DoRA options are maintained upstream, and the cost of the
wrapper (one extra ``A`` then ``B`` matmul per adapted linear) is the same arithmetic a
hand-written layer would do. What lmms adds is what peft leaves to the caller: a deterministic
initialisation that does not depend on the device the model was built on (a meta-device FSDP2
build and a one-process build start from the same adapters), the state-dict mapping for loading
base weights into the adapted model, the adapter-off context (the DPO reference, no second model)
and the two exports (peft's adapter folder, merged full weights).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["LoraHandle", "LoraOptions", "apply_lora", "quantize_base_nf4"]

TOWER_CHOICES = ("lora", "frozen", "full")
_ADAPTER = "default"  # peft's adapter name (stripped from the exported keys, as peft does)


@dataclass(kw_only=True, slots=True)
class LoraOptions:
    """What :func:`apply_lora` adapts; ``model_config.lora`` in the trainer's YAML.

    * ``rank`` / ``alpha``: the update is ``(alpha / rank) · B A`` (``alpha / sqrt(rank)`` with
      ``use_rslora``).
    * ``dropout``: peft's dropout on the adapter input (torch's global RNG).
    * ``target_modules``: ``"all-linear"`` (every ``nn.Linear`` inside the ``lora`` towers) or a
      list of patterns, each a module-name suffix (``q_proj``, ``mlp.down_proj``) or a regular
      expression matched against the whole module name.
    * ``towers``: ``{tower: lora | frozen | full}`` over the towers the family declares
      (``decoder``, ``vision``, ``audio``); towers not named take ``frozen`` (the decoder ``lora``).
    * ``train``: module-name prefixes trained whole besides (e.g. a projector).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    towers: dict[str, str] = field(default_factory=lambda: {"decoder": "lora"})
    train: list[str] = field(default_factory=list)
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        for tower, choice in self.towers.items():
            if choice not in TOWER_CHOICES:
                raise ValueError(
                    f"lora.towers.{tower}: {choice!r} is not one of {', '.join(TOWER_CHOICES)}"
                )

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _matches(name: str, patterns: str | list[str]) -> bool:
    if patterns == "all-linear":
        return True
    pats = [patterns] if isinstance(patterns, str) else patterns
    return any(name == p or name.endswith("." + p) or re.fullmatch(p, name) for p in pats)


def _tower_modules(spec: Any, model: nn.Module, opts: LoraOptions) -> dict[str, nn.Module]:
    towers = {k: v for k, v in spec.towers(model).items() if v is not None}
    unknown = sorted(set(opts.towers) - set(towers))
    if unknown:
        raise ValueError(
            f"lora.towers: {spec.name} has no {', '.join(unknown)} tower; "
            f"its towers: {', '.join(towers)}"
        )
    return towers


def _targets(spec: Any, model: nn.Module, opts: LoraOptions) -> list[str]:
    """Names (from the model root) of the ``nn.Linear`` modules that get adapters."""
    names = {id(m): n for n, m in model.named_modules()}
    head = spec.lm_head(model)
    out: list[str] = []
    for tower, module in _tower_modules(spec, model, opts).items():
        if opts.towers.get(tower, "frozen") != "lora":
            continue
        for mod in module.modules():
            name = names[id(mod)]
            if (
                isinstance(mod, nn.Linear)
                and mod is not head
                and _matches(name, opts.target_modules)
            ):
                out.append(name)
    if not out:
        raise ValueError(
            f"lora.target_modules {opts.target_modules!r} matches no linear layer of the "
            f"{', '.join(t for t, c in opts.towers.items() if c == 'lora') or 'no'} tower(s) "
            f"of {spec.name}"
        )
    return sorted(set(out))


def _init_adapter(name: str, shape_a: tuple[int, int], seed: int) -> torch.Tensor:
    """``lora_A`` of module ``name``: uniform(±1/sqrt(in_features)), peft's default
    (kaiming-uniform with a=sqrt(5)), drawn from a CPU generator seeded by ``seed`` and the name,
    so the values do not depend on the device, the build order or the number of ranks."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % 2**63)
    bound = 1.0 / math.sqrt(shape_a[1])
    return torch.rand(shape_a, generator=g, dtype=torch.float32).mul_(2 * bound).sub_(bound)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the dequantised values of a torchao NF4 tensor (QLoRA's base weights)."""
    if type(t).__name__ != "NF4Tensor":  # torchao is optional: no import unless one is here
        return t
    return t.get_original_weight()


def _stable_hash(text: str) -> int:
    h = 1469598103934665603  # FNV-1a, 64 bit (Python's hash() is salted per process)
    for byte in text.encode():
        h = ((h ^ byte) * 1099511628211) % 2**64
    return h


class LoraHandle:
    """The adapters of one model: their names, the adapter-off context, the state-dict maps."""

    def __init__(self, model: nn.Module, targets: list[str], opts: LoraOptions, peft_config: Any):
        self.model = model
        self.targets = targets
        self.options = opts
        self.peft_config = peft_config
        self._layers = [model.get_submodule(n) for n in targets]
        self._target_set = set(targets)

    # ---------------------------------------------------------------- running
    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the base model: every adapter off (peft's ``disable_adapters`` flag on each layer,
        set without peft's ``enable_adapters``, which also flips ``requires_grad`` of the adapter
        weights, something FSDP2 must not see mid-run)."""
        saved = [layer._disable_adapters for layer in self._layers]
        for layer in self._layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer, flag in zip(self._layers, saved, strict=True):
                layer._disable_adapters = flag

    def initial_adapters(self, seed: int) -> dict[str, torch.Tensor]:
        """The adapters' initial values keyed as in the adapted model's state dict (``B`` zero)."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in zip(self.targets, self._layers, strict=True):
            a = layer.lora_A[_ADAPTER].weight
            b = layer.lora_B[_ADAPTER].weight
            out[f"{name}.lora_A.{_ADAPTER}.weight"] = _init_adapter(name, tuple(a.shape), seed)
            out[f"{name}.lora_B.{_ADAPTER}.weight"] = torch.zeros(tuple(b.shape))
        return out

    def reset_adapters(self, seed: int) -> None:
        """Write :meth:`initial_adapters` into a materialised (not sharded) model."""
        with torch.no_grad():
            for key, value in self.initial_adapters(seed).items():
                p = self.model.get_parameter(key)
                p.copy_(value.to(p.device, p.dtype))

    # ---------------------------------------------------------------- state-dict maps
    def to_adapted_key(self, key: str) -> str:
        """A base checkpoint key -> the adapted model's key (``q_proj.weight`` ->
        ``q_proj.base_layer.weight``)."""
        mod, _, leaf = key.rpartition(".")
        return f"{mod}.base_layer.{leaf}" if mod in self._target_set else key

    def adapted_state(self, base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        """A full base state dict renamed for the adapted model, with the initial adapters."""
        out = {self.to_adapted_key(k): v for k, v in base.items()}
        out.update(self.initial_adapters(seed))
        return out

    def merged_state(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapted model's full state dict -> the upstream model's, ``W + s · B A`` merged
        (computed in fp32, written in each base weight's dtype)."""
        s = self.options.scaling
        out: dict[str, torch.Tensor] = {}
        for key, value in full.items():
            if ".lora_A." in key or ".lora_B." in key:
                continue
            value = _dense(value)  # a QLoRA base weight: its dequantised values
            mod, _, leaf = key.rpartition(".")
            if mod.endswith(".base_layer"):
                name = mod[: -len(".base_layer")]
                if leaf == "weight":
                    a = full[f"{name}.lora_A.{_ADAPTER}.weight"].float()
                    b = full[f"{name}.lora_B.{_ADAPTER}.weight"].float()
                    value = (value.float() + s * (b @ a)).to(value.dtype)
                key = f"{name}.{leaf}"
            out[key] = value
        return out

    def adapter_state(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter weights in peft's saved format: ``base_model.model.<module>.lora_A.weight``
        (the adapter name stripped, as ``PeftModel.save_pretrained`` writes them)."""
        return {
            "base_model.model." + k.replace(f".{_ADAPTER}.", "."): v.contiguous()
            for k, v in full.items()
            if ".lora_A." in k or ".lora_B." in k
        }

    def save_adapter(
        self, full: dict[str, torch.Tensor], out_dir: str | Path, *, base_model: str | None = None
    ) -> Path:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (peft's layout, loaded by
        ``PeftModel.from_pretrained(upstream_model, out_dir)``). ``full``: the adapted model's
        full state dict (e.g. lmms_parallel.gather_full_state_dict)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.peft_config.base_model_name_or_path = base_model
        self.peft_config.save_pretrained(str(out))
        tensors = {k: v.detach().cpu() for k, v in self.adapter_state(full).items()}
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        return out

    def summary(self) -> dict[str, Any]:
        """What was adapted (for logs and tests)."""
        return {"targets": len(self.targets), **asdict(self.options)}

    def __repr__(self) -> str:
        return f"LoraHandle({json.dumps(self.summary())})"


def apply_lora(spec: Any, model: nn.Module, opts: LoraOptions, *, seed: int = 0) -> LoraHandle:
    """Inject peft's LoRA layers into ``model`` in place (before any parallelism; on the meta
    device too) and set what trains: the adapters, the ``full`` towers, the ``train`` prefixes.

    A materialised model gets :meth:`LoraHandle.initial_adapters` now; a meta-device model gets
    them with its weights (:meth:`LoraHandle.adapted_state`).
    """
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:  # pragma: no cover - the extra is part of the dev environment
        raise ImportError("LoRA needs peft: pip install 'lmms-models[lora]'") from exc

    towers = _tower_modules(spec, model, opts)
    targets = _targets(spec, model, opts)
    config = LoraConfig(
        r=opts.rank,
        lora_alpha=opts.alpha,
        lora_dropout=opts.dropout,
        target_modules=targets,
        use_rslora=opts.use_rslora,
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
    for p in model.parameters():  # peft leaves only adapters trainable; be explicit anyway
        p.requires_grad_(False)
    handle = LoraHandle(model, targets, opts, config)
    for layer in handle._layers:
        for p in [*layer.lora_A.parameters(), *layer.lora_B.parameters()]:
            p.requires_grad_(True)
    for tower, module in towers.items():
        if opts.towers.get(tower, "frozen") == "full":
            for p in module.parameters():
                p.requires_grad_(True)
    params = dict(model.named_parameters())
    for prefix in opts.train:
        hits = [n for n in params if n.startswith(prefix + ".") or n == prefix]
        if not hits:
            raise ValueError(f"lora.train: {prefix!r} names no module of {spec.name}")
        for n in hits:
            params[n].requires_grad_(True)
    if not any(p.is_meta for p in model.parameters()):
        handle.reset_adapters(seed)
    return handle


def quantize_base_nf4(handle: LoraHandle, *, block_size: int = 64) -> int:
    """QLoRA: replace the frozen base weight of every adapted linear by torchao's ``NF4Tensor``
    (4-bit NormalFloat, blocks of ``block_size`` with double-quantised scales; ~0.53 bytes per
    weight). ``F.linear`` on it dequantises to the input's dtype (torchao's ``linear_nf4``), so
    peft's layer runs unchanged and gradients reach the adapters and the input, never the base.
    Call on the materialised model (after its weights are loaded), before any optimizer is built.

    Under FSDP2 (the base weights are sharded DTensors) each weight is gathered whole, quantised
    (the same 4-bit values as one process) and sharded again as NF4 (lmms_parallel's
    :func:`~lmms_parallel.replace_sharded_param`): NF4Tensor implements FSDP2's all-gather
    extension, so the shards stay 4-bit and are all-gathered in 4 bits. A weight whose shards do
    not split into whole scaler blocks (``block_size`` x 256 values each; tiny test shapes) stays
    as it is. Returns how many were quantised. ``pip install 'lmms-models[qlora]'``."""
    try:
        from torchao.quantization import to_nf4
    except ImportError as exc:  # pragma: no cover
        raise ImportError("QLoRA needs torchao: pip install 'lmms-models[qlora]'") from exc
    from torch.distributed.tensor import DTensor

    def quantize(w: torch.Tensor) -> torch.Tensor:
        return to_nf4(w.detach(), block_size, 256)

    done = 0
    for name, layer in zip(handle.targets, handle._layers, strict=True):
        w = layer.base_layer.weight
        shards = w.device_mesh.size(len(w.placements) - 1) if isinstance(w, DTensor) else 1
        if w.size(0) % shards or (w.numel() // shards) % (block_size * 256):
            continue
        if isinstance(w, DTensor):
            from lmms_parallel import replace_sharded_param

            replace_sharded_param(handle.model, f"{name}.base_layer.weight", quantize)
        else:
            layer.base_layer.weight = nn.Parameter(quantize(w), requires_grad=False)
        done += 1
    return done
