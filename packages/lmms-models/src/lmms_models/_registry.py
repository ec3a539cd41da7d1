"""The model-spec registry: a dict filled by a decorator (one mechanism, STYLE.md #5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ._spec import ModelSpec

__all__ = ["MODEL_REGISTRY", "get_model_spec", "list_models", "register_model"]

MODEL_REGISTRY: dict[str, ModelSpec] = {}

_S = TypeVar("_S", bound=type)


def register_model(name: str) -> Callable[[_S], _S]:
    """Class decorator: instantiate the spec class and register it under ``name``.

    Refuses a name that is already taken, so two families can never silently shadow each other.
    """

    def deco(cls: _S) -> _S:
        if name in MODEL_REGISTRY:
            raise ValueError(
                f"model {name!r} is already registered (by {type(MODEL_REGISTRY[name]).__name__})"
            )
        spec = cls()
        spec.name = name
        MODEL_REGISTRY[name] = spec
        return cls

    return deco


def list_models() -> list[str]:
    """Names of the registered model families, sorted."""
    _load_families()
    return sorted(MODEL_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec for ``name``; the error lists what is registered."""
    _load_families()
    try:
        return MODEL_REGISTRY[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, MODEL_REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(
            f"unknown model {name!r}.{hint} Registered: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


def _load_families() -> None:
    # Importing the families package runs every family's @register_model once.
    from . import families  # noqa: F401
