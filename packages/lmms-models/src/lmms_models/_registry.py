"""The model-spec registry: a dict filled by a decorator (one mechanism, STYLE.md #5).

Families are imported on first use, each on its own: ``get_model_spec(name)`` imports only the
folder ``families/<name>`` (and what it imports), ``list_models()`` every folder. A family whose
import fails (an optional dependency missing, or installed but broken: soundfile without its C
library) is left out of the registry with one line naming the package to install or repair
(``unavailable_models()``); ``get_model_spec`` of it raises :class:`FamilyUnavailableError` with
that line, and every other family still loads.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ._spec import ModelSpec

__all__ = [
    "MODEL_REGISTRY",
    "FamilyUnavailableError",
    "get_model_spec",
    "list_models",
    "register_model",
    "unavailable_models",
]

MODEL_REGISTRY: dict[str, ModelSpec] = {}
_UNAVAILABLE: dict[str, str] = {}  # family folder -> why its import failed (one line)
_TRIED: set[str] = set()  # family folders imported (or tried) in this process

_S = TypeVar("_S", bound=type)

#: what installs a third-party package that families import (pip requirement)
EXTRAS = {
    "diffusers": "lmms-models[diffusion]",
    "fla": "lmms-models[fla]",
    "peft": "lmms-models[lora]",
    "torchao": "lmms-models[qlora]",
    "soundfile": "lmms-data[audio]",  # transformers' audio models import it when it is installed
}
_NOT_CULPRITS = {"lmms_models", "transformers", "importlib", "torch"}


class FamilyUnavailableError(ImportError):
    """A registered family folder whose import failed; the message is one line saying what to
    install or repair."""


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
    """Names of the registered model families that import here, sorted (the others:
    ``unavailable_models()``)."""
    for folder in _family_folders():
        _load_family(folder)
    return sorted(MODEL_REGISTRY)


def unavailable_models() -> dict[str, str]:
    """Family folders whose import failed here -> one line naming what to install or repair."""
    list_models()
    return dict(sorted(_UNAVAILABLE.items()))


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec for ``name``; the error lists what is registered."""
    if name not in MODEL_REGISTRY and name in _family_folders():
        _load_family(name)
    if name in _UNAVAILABLE:
        raise FamilyUnavailableError(_UNAVAILABLE[name])
    if name not in MODEL_REGISTRY:
        list_models()
    try:
        return MODEL_REGISTRY[name]
    except KeyError:
        raise unknown_name("model", name, MODEL_REGISTRY) from None


def unknown_name(kind: str, name: str, registry: Iterable[str]) -> KeyError:
    """The error for a ``name`` that ``registry`` lacks: the closest registered name, if any,
    and every registered one."""
    import difflib

    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return KeyError(f"unknown {kind} {name!r}.{hint} Registered: {', '.join(sorted(registry))}")


def _family_folders() -> list[str]:
    from . import families

    return sorted(m.name for m in pkgutil.iter_modules(families.__path__) if m.name[0] != "_")


def _load_family(folder: str) -> None:
    """Import ``families.<folder>`` once; on failure record why and drop what it registered."""
    if folder in _TRIED:
        return
    _TRIED.add(folder)
    module = f"{__package__}.families.{folder}"
    try:
        importlib.import_module(module)
    except Exception as exc:  # any import-time failure (an OSError from a C library too)
        for key in [k for k, s in MODEL_REGISTRY.items() if type(s).__module__.startswith(module)]:
            del MODEL_REGISTRY[key]
        sys.modules.pop(module, None)
        _UNAVAILABLE[folder] = _why(folder, exc)


def _why(folder: str, exc: BaseException) -> str:
    culprit = _culprit(exc)
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    if culprit in EXTRAS:
        fix = f"install or repair {culprit}: pip install '{EXTRAS[culprit]}'"
    elif culprit:
        fix = f"install or repair the package {culprit!r}"
    else:
        fix = "see the error"
    return f"model family {folder!r} is unavailable ({detail}): {fix}"


def _culprit(exc: BaseException) -> str | None:
    """The top-level package whose import failed: a missing module's name, else the innermost
    module being imported when the error was raised (outside lmms_models and transformers)."""
    if isinstance(exc, ImportError) and exc.name:
        top = exc.name.split(".")[0]
        if top not in _NOT_CULPRITS:
            return top
    found, tb = None, exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "_find_and_load" and isinstance(frame.f_locals.get("name"), str):
            top = frame.f_locals["name"].split(".")[0]
            found = top if top not in _NOT_CULPRITS else found
        tb = tb.tb_next
    cause = exc.__cause__ or exc.__context__
    return found or (_culprit(cause) if cause is not None else None)
