"""Which keys a family's config dict may hold: a key tree read from the config class itself.

``key_tree(config)`` maps every key the config object reads to ``None`` (a value) or to the
key tree of a nested config (a transformers sub-config such as ``text_config``, or a nested
dataclass such as BAGEL's ``llm``). ``unknown_keys(tree, user)`` walks a user's dict against it
and returns the keys no config reads (a typo like ``hiden_size`` would otherwise be stored as a
stray attribute by transformers and silently ignored). A nested dict under a key whose value is
free-form (``rope_scaling``) is not walked.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["as_dict", "ignored_keys", "key_tree", "unknown_keys"]


def _init_params(cls: type) -> set[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}


def key_tree(config: Any) -> dict[str, Any]:
    """``{key: None | subtree}`` of a config object (transformers, dataclass or mapping)."""
    from transformers import PreTrainedConfig

    if isinstance(config, PreTrainedConfig):  # before dataclasses: v5 configs are dataclasses
        cls = type(config)
        keys = set(config.to_dict()) | _init_params(cls) | set(getattr(cls, "attribute_map", {}))
        keys |= set(getattr(cls, "sub_configs", {}) or {}) | {"model_type"}
        tree: dict[str, Any] = dict.fromkeys(keys)
        for key in keys:
            value = getattr(config, key, None)
            if isinstance(value, PreTrainedConfig):
                tree[key] = key_tree(value)
        return tree
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {
            f.name: key_tree(v) if dataclasses.is_dataclass(v := getattr(config, f.name)) else None
            for f in dataclasses.fields(config)
        }
    if isinstance(config, Mapping):
        return dict.fromkeys(config)
    return {}


def as_dict(config: Any) -> dict[str, Any]:
    """A config object's values as a plain dict (transformers, dataclass or mapping)."""
    from transformers import PreTrainedConfig

    if isinstance(config, PreTrainedConfig):
        return config.to_dict()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config)


def _sub_tree(value: Mapping[str, Any], default: Any) -> Any:
    """The tree of a nested config dict that names its own ``model_type`` (transformers)."""
    model_type = value.get("model_type")
    if isinstance(model_type, str):
        from transformers import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:
            return key_tree(CONFIG_MAPPING[model_type]())
    return default


def unknown_keys(
    tree: Mapping[str, Any], user: Mapping[str, Any], where: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], str]]:
    """``(path, "'dotted.key' (did you mean ...?)")`` of each key of ``user`` not in ``tree``.
    Token ids (``*_token_id``, ``*_token_index``: the trainer and processors manage them) pass."""
    import difflib

    out: list[tuple[tuple[str, ...], str]] = []
    for key, value in user.items():
        path = (*where, str(key))
        if key not in tree and not str(key).endswith(("_token_id", "_token_index")):
            close = difflib.get_close_matches(str(key), [str(k) for k in tree], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.append((path, f"{'.'.join(path)!r}{hint}"))
            continue
        sub = tree.get(key)
        if isinstance(sub, dict) and isinstance(value, Mapping):
            out.extend(unknown_keys(_sub_tree(value, sub), value, path))
    return out


def _without(conf: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(conf)
    node = out
    for part in path[:-1]:
        node = node[part]
    node.pop(path[-1], None)
    return out


def ignored_keys(
    make: Callable[[dict[str, Any]], Any],
    tree: Mapping[str, Any],
    conf: dict[str, Any],
    user: Mapping[str, Any],
) -> list[str]:
    """The keys of ``user`` (merged into ``conf``) that the config built by ``make`` ignores:
    not in ``tree``, and the built config's other values are the same without them (a key
    that transformers consumes through ``**kwargs``, e.g. ``rope_theta`` into
    ``rope_parameters``, changes them and passes)."""
    out = []
    for path, text in unknown_keys(tree, user):
        try:
            with_key = as_dict(make(conf))
            without = as_dict(make(_without(conf, path)))
        except Exception:  # a build failure is the caller's to report
            out.append(text)
            continue
        if _pop(with_key, path) == _pop(without, path):
            out.append(text)
    return out


def _pop(values: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    try:
        return _without(values, path)
    except (KeyError, TypeError):
        return values
