"""Find what would make the host wait for the GPU, on CPU.

There is no device here, so "device" tensors are tracked by provenance: the tensors a test
declares (parameters, buffers, the batch except its host keys) and every result of an op that
reads one of them. An op that a CUDA run can only answer by reading device memory on the host is
recorded when one of its tensor arguments is such a tensor:

* scalar reads: ``aten::_local_scalar_dense`` (``.item()``, ``bool()``, ``int()``), ``aten::item``,
  ``aten::is_nonzero``, ``aten::equal``, and ``Tensor.tolist()`` / ``.item()`` / ``__bool__``
  at the Python level (``tolist`` does not reach the dispatcher on CPU);
* data-dependent sizes: ``aten::nonzero``, ``aten::masked_select``, ``aten::unique*``,
  ``aten::bincount``, ``aten::repeat_interleave`` without ``output_size``, and indexing
  (``aten::index``, ``aten::index_put``) with a boolean index.

Host-side work (metadata the trainer keeps on the host, e.g. ``mm_token_type_ids``) is not
recorded. Limitation: a host tensor sent to the device by ``lmms_models.to_device`` stays the same
CPU tensor here, so reads of it would go unnoticed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SCALAR_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}
_DATA_SIZED = {"nonzero", "masked_select", "bincount", "unique", "_unique", "_unique2"}
_DATA_SIZED |= {"unique_consecutive", "unique_dim"}
_PY_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}


class DeviceReads:
    """Context recording host reads of device tensors: ``reads`` holds ``aten::`` / ``Tensor.``
    names in call order. ``device(*tensors)`` declares device tensors (call before entering).
    ``ignore``: functions whose reads are not recorded (e.g. a CPU-only reference kernel)."""

    def __init__(self, ignore: tuple[Callable, ...] = ()) -> None:
        self.reads: list[str] = []
        self._ignore = {fn.__code__ for fn in ignore}
        self._live: dict[int, torch.Tensor] = {}  # storage address -> a tensor keeping it alive
        outer = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                outer._dispatched(func, args, kwargs, out)
                return out

        class _Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in _PY_READS and args and outer._on_device(args[0]):
                    outer._record(f"Tensor.{name}")
                return func(*args, **(kwargs or {}))

        self._modes = (_Function(), _Dispatch())

    def _record(self, name: str) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code in self._ignore:
                return
            frame = frame.f_back
        self.reads.append(name)

    def device(self, *tensors: Any) -> DeviceReads:
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._mark(t)
        return self

    def _mark(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr:  # kept alive while recording: no later host tensor reuses the address
            self._live.setdefault(ptr, t)

    def _on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._live

    def _dispatched(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(self._on_device(t) for t in inputs):
            return
        name = func._schema.name.split("::")[-1]
        bool_index = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1])[0]
        )
        unsized = (
            name == "repeat_interleave"
            and func._overloadname in ("Tensor", "self_Tensor")
            and kwargs.get("output_size") is None
        )
        if name in _SCALAR_READS or name in _DATA_SIZED or bool_index or unsized:
            self._record(f"aten::{name}" + (" (bool index)" if bool_index else ""))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._mark(t)

    def __enter__(self) -> DeviceReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._live.clear()


def device_tensors(model: torch.nn.Module, batch: dict[str, Any], host_keys: tuple) -> list:
    """What the trainer keeps on the device: parameters, buffers, the batch but ``host_keys``."""
    out = list(model.parameters()) + list(model.buffers())
    out += [v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in host_keys]
    return out
