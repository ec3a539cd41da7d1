"""Meta-device construction, materialisation and rank-0 weight loading with broadcast.

The recipe (never a full model copy per rank in CPU memory)::

    with meta_init():                      # parameters on meta, buffers real (tiny)
        model = build_model(config)
    apply_fsdp(model, fsdp_mesh(mesh), blocks=...)
    materialize(model, device)             # to_empty + restore/recompute non-persistent buffers
    load_full_state_dict(model, "ckpt/")   # rank 0 reads safetensors, broadcasts shard by shard

Non-persistent buffers (rotary ``inv_freq``) are not in any checkpoint and ``to_empty`` leaves
them as garbage. ``materialize`` restores them from the values captured at construction when the
model was built under :func:`meta_init` (which keeps buffers on CPU); buffers built on meta by
``with torch.device("meta")`` are recomputed for Hugging Face rotary modules (``rope_type`` +
``config`` + ``compute_<type>_rope_parameters`` or transformers' ``ROPE_INIT_FUNCTIONS``) or by a
``buffer_init`` callback; anything else raises, naming the buffer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

__all__ = ["load_full_state_dict", "materialize", "meta_init", "read_safetensors"]

BufferInit = Callable[[nn.Module, str, torch.device], torch.Tensor | None]


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers on CPU.

    Each parameter is created by its module on CPU and moved to meta as it is registered, so the
    transient cost is one parameter, never the model. Scoped: ``nn.Module.register_parameter`` is
    restored on exit, also on error.
    """
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(
    model: nn.Module, device: torch.device | str, *, buffer_init: BufferInit | None = None
) -> nn.Module:
    """Allocate (uninitialised) storage for a meta model on ``device`` and fix its buffers.

    Call after ``apply_fsdp`` (so each rank allocates only its shards) and before loading weights.
    Persistent buffers are left for the state-dict load; non-persistent ones are restored or
    recomputed as described in the module docstring.
    """
    device = torch.device(device)
    saved: dict[str, torch.Tensor] = {}
    missing: list[tuple[nn.Module, str, str]] = []
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name not in module._non_persistent_buffers_set:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            if buf.device.type == "meta":
                missing.append((module, name, fqn))
            else:
                saved[fqn] = buf.detach().clone()
    model.to_empty(device=device)
    with torch.no_grad():
        for fqn, value in saved.items():
            model.get_buffer(fqn).copy_(value)
        for module, name, fqn in missing:
            value = buffer_init(module, name, device) if buffer_init else None
            if value is None:
                value = _hf_rope_buffer(module, name, device)
            if value is None:
                raise RuntimeError(
                    f"cannot re-initialise the non-persistent buffer {fqn!r} "
                    f"({type(module).__name__}) after meta init: build the model under "
                    "lmms_parallel.meta_init() (keeps buffers real) or pass buffer_init="
                )
            getattr(module, name).copy_(value)
    return model


def _hf_rope_buffer(module: nn.Module, name: str, device: torch.device) -> torch.Tensor | None:
    """Recompute ``inv_freq`` / ``original_inv_freq`` of a Hugging Face rotary module."""
    if name not in ("inv_freq", "original_inv_freq"):
        return None
    rope_type = getattr(module, "rope_type", None)
    config = getattr(module, "config", None)
    if rope_type is None or config is None:
        return None
    fn = getattr(module, f"compute_{rope_type}_rope_parameters", None)
    if fn is None:
        try:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        except ImportError:
            return None
        fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if fn is None:
        return None
    inv_freq, _ = fn(config)
    return inv_freq.to(device)


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file or every ``*.safetensors`` in a folder (CPU tensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file), device="cpu"))
    return out


def load_full_state_dict(
    model: nn.Module,
    source: str | os.PathLike | dict[str, torch.Tensor] | None,
    *,
    key_map: Callable[[str], str | None] | None = None,
    strict: bool = True,
) -> None:
    """Load full (unsharded) weights read on rank 0 only, broadcast to every rank's shards.

    Args:
        source: on rank 0, a safetensors file/folder or a state dict keyed by the model's
            parameter names; ignored on other ranks (pass ``None``).
        key_map: renames checkpoint keys to the model's names (``None`` drops the key); model
            specific key layouts come from the model spec.
        strict: raise if a model weight is missing from the checkpoint.

    Collective: every rank must call it. Memory: rank 0 holds the full CPU state dict once.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    full: dict[str, torch.Tensor] = {}
    if rank0:
        if source is None:
            raise ValueError("rank 0 must pass the weights (a path or a state dict)")
        # a shallow copy: torch's set_model_state_dict writes the loaded (sharded) tensors back
        # into the dict it is given, which would leave the caller's weights holding DTensors
        full = dict(source) if isinstance(source, dict) else read_safetensors(source)
        if key_map is not None:
            mapped = {}
            for key, value in full.items():
                new = key_map(key)
                if new is not None:
                    mapped[new] = value
            full = mapped
        full = match_saved_names(full, model.state_dict())
    if not dist.is_initialized():
        model.load_state_dict(full, strict=strict)
        return
    from ._ep import ep_params, load_ep_params

    if ep_params(model):  # expert-parallel slices: broadcast whole, sliced per rank
        load_ep_params(model, full, strict=strict)
        if strict:  # the expert keys are loaded; rank 0 checks the rest and tells every rank
            box: list[Any] = [None]
            if rank0:
                box[0] = [
                    k for k in model.state_dict() if k not in full and not _is_ep_key(model, k)
                ]
            dist.broadcast_object_list(box, src=0)
            if box[0]:
                raise KeyError(f"the weights miss {len(box[0])} keys, e.g. {box[0][:5]}")
        strict = False
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, full, options=options)


def match_saved_names(
    saved: dict[str, torch.Tensor], expected: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename checkpoint keys that the model names under another prefix, by unique suffix.

    A release's files and the model class can name the same weight differently: transformers 5
    saves Qwen-VL families in the released layout (``visual.blocks.0...``, ``model.layers.0...``)
    while its modules are ``model.visual.blocks.0...`` and ``model.language_model.layers.0...``;
    ``from_pretrained`` renames on load, a meta-device build loaded here must too. Each saved key
    the model lacks is matched to the one model key that ends with its longest possible tail
    (``x.y.z`` -> ``...y.z``), that no saved key already names and whose shape is the same; where
    several model keys end so, the one whose prefix holds the same parts reordered
    (LLaVA-OneVision's ``language_model.model.layers.0`` -> ``model.language_model.layers.0``).
    A key with no such unique match is left as it is (the strict load then names it): no guess.
    """
    missing = set(expected) - set(saved)
    unknown = [k for k in saved if k not in expected]
    if not missing or not unknown:
        return saved
    by_tail: dict[str, list[str]] = {}
    for key in missing:
        parts = key.split(".")
        for i in range(len(parts)):
            by_tail.setdefault(".".join(parts[i:]), []).append(key)
    renamed, taken = {}, set()
    for key in unknown:
        parts = key.split(".")
        for i in range(len(parts)):
            hits = by_tail.get(".".join(parts[i:]), [])
            if not hits:
                continue  # no model key ends so: try a shorter tail
            if len(hits) > 1:  # several: the one whose prefix has the same parts, reordered
                prefix = sorted(parts[:i])
                hits = [
                    h
                    for h in hits
                    if sorted(h.split(".")[: h.count(".") + 1 - (len(parts) - i)]) == prefix
                ]
            same = len(hits) == 1 and tuple(expected[hits[0]].shape) == tuple(saved[key].shape)
            if same and hits[0] not in taken:
                renamed[key] = hits[0]
                taken.add(hits[0])
            break  # the longest tail that names model keys decides (still several: ambiguous)
    if len(set(renamed.values())) != len(renamed):
        return saved
    return {renamed.get(k, k): v for k, v in saved.items()}


def _is_ep_key(model: nn.Module, key: str) -> bool:
    from ._ep import ep_params

    return key in {fqn for fqn, *_ in ep_params(model)}
