"""One small registry mechanism (a dict filled by a decorator) and the config-key checker."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name missing from a registry (a KeyError whose message prints unquoted)."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """A name -> object dict filled by a decorator; refuses duplicates, lists entries in errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._items[name]!r}); "
                    "pick another name"
                )
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._items:
            hint = difflib.get_close_matches(name, list(self._items), n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; registered: {sorted(self._items)}.{extra}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


DATASET_REGISTRY: Registry[Callable[[dict[str, Any]], dict[str, Any]]] = Registry("dataset type")
PROCESSOR_REGISTRY: Registry[Any] = Registry("processor family")


def register_dataset(name: str):
    """Register a record adapter: ``fn(raw_record: dict) -> {"messages": [...], ...}``.

    The adapter turns one row of any custom schema into the chat-record format (see docs/data.md);
    set ``dataset_type: name`` in the config to use it. Readers, sharding, shuffling, packing and
    resume are unchanged, so a new format needs no engine change.
    """
    return DATASET_REGISTRY.register(name)


def register_processor(name: str):
    """Register a processor class for a model family (see ``lmms_data.processors.QwenVLProcessor``)."""
    return PROCESSOR_REGISTRY.register(name)


def check_keys(
    given: Mapping[str, Any] | Iterable[str], allowed: Iterable[str], where: str
) -> None:
    """Raise ``ValueError`` naming every unknown key in ``given``, with a difflib suggestion."""
    allowed = list(allowed)
    bad = [k for k in given if k not in allowed]
    if not bad:
        return
    parts = []
    for k in bad:
        hint = difflib.get_close_matches(k, allowed, n=1)
        parts.append(f"{k!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    raise ValueError(f"unknown key(s) in {where}: {', '.join(parts)}; allowed: {sorted(allowed)}")
