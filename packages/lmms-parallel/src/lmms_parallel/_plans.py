"""Parallel plans as data: ``{module pattern: style name}``, applied from outside.

A model spec states its plans (lmms-models: ``spec.tp_plan``, ``spec.ep_plan``), e.g.::

    tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
               "layers.*.self_attn.q_norm": "sum_grad", ...}
    ep_plan = {"layers.*.mlp.experts": "experts"}

Patterns are ``fnmatch`` patterns over module names relative to the module the plan is applied to
(the text decoder for both plans above); the empty pattern ``""`` names that module itself (its
name in ``named_modules()``); every pattern must match at least one module. Styles are
looked up in a registry (:func:`register_style`): a new family adds a plan, a new *kind* of layer
adds a style; a style that only one family's layers need is the family's own, handed in with its
plan (``apply_tp(..., styles=)``: lmms_models' ``ModelSpec.plan_styles``). Built in:

* TP (on the ``tp`` mesh dim): ``colwise``, ``rowwise`` (torch DTensor, local outputs),
  ``sum_grad`` (replicated module on local activations: gradient summed over TP) and
  ``vocab_parallel`` (the LM head's rows split over TP; the loss reads the local rows:
  :func:`lmms_parallel.vocab_parallel_cross_entropy`, never ``[T, vocab]``), and for sequence
  parallelism inside TP (``tp_sequence_parallel``, lmms_parallel._tp_sp) ``rowwise_sp``,
  ``sp_scatter_input``, ``sp_gather_input``, ``sp_gather_output``;
* EP (on the EP group): ``experts`` (transformers' 3-D experts: local slice + all-to-all);
* SP (Ulysses over the SP group, for models whose tokens are not split at the text decoder's
  inputs; :func:`lmms_parallel.apply_sp`, reversible): ``sp_split_tokens``,
  ``sp_tokens_to_heads``, ``sp_heads_to_tokens``, ``sp_local_heads``, ``sp_gather_tokens``,
  ``sp_replicated_grad`` (lmms_parallel._sp_plans) and ``sp_row_stack``, ``sp_row_attention``
  (lmms_parallel._row_sp).

Order (STYLE.md #3): TP/EP, then activation checkpointing, compile, FSDP2; from the meta device:
the EP slice of a meta parameter is a meta parameter, DTensor ``parallelize_module`` works on
meta modules, and :func:`lmms_parallel.load_full_state_dict` slices the full weights it
broadcasts (:func:`plan_shard_hooks`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._ep import ExpertParallel
from ._tp import SumGradOverGroup, tp_style
from ._tp_sp import (
    SeqGatherInput,
    SeqGatherOutput,
    SeqScatterInput,
    rowwise_sp_style,
)
from ._vocab_parallel import VocabParallelHead

__all__ = ["apply_ep", "apply_tp", "match_plan", "register_style", "registered_styles"]

#: kind ("tp" | "ep" | "sp") -> style name -> factory(mesh, group or SPContext) -> object with
#: .apply(module) or a DTensor ParallelStyle
_STYLES: dict[str, dict[str, Callable[[Any], Any]]] = {"tp": {}, "ep": {}, "sp": {}}


def register_style(kind: str, name: str) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator: register ``factory(mesh_or_group)`` as style ``name`` of ``kind`` ("tp"/"ep"/
    "sp"). The factory returns a DTensor ``ParallelStyle`` (TP) or an object with
    ``apply(module)`` (SP: ``factory(SPContext)``, ``apply`` returns the undo callables)."""
    if kind not in _STYLES:
        raise ValueError(f"style kind must be one of {sorted(_STYLES)}, got {kind!r}")

    def deco(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
        if name in _STYLES[kind]:
            raise ValueError(f"{kind} style {name!r} is already registered")
        _STYLES[kind][name] = factory
        return factory

    return deco


def registered_styles(kind: str) -> list[str]:
    return sorted(_STYLES[kind])


register_style("tp", "colwise")(lambda mesh: tp_style("colwise"))
register_style("tp", "rowwise")(lambda mesh: tp_style("rowwise"))
register_style("tp", "sum_grad")(lambda mesh: SumGradOverGroup(mesh.get_group()))
register_style("tp", "vocab_parallel")(lambda mesh: VocabParallelHead(mesh))
register_style("tp", "rowwise_sp")(lambda mesh: rowwise_sp_style())
register_style("tp", "sp_scatter_input")(lambda mesh: SeqScatterInput(mesh.get_group()))
register_style("tp", "sp_gather_input")(lambda mesh: SeqGatherInput(mesh.get_group()))
register_style("tp", "sp_gather_output")(lambda mesh: SeqGatherOutput(mesh.get_group()))
register_style("ep", "experts")(lambda group: ExpertParallel(group))


def match_plan(root: nn.Module, plan: Mapping[str, str]) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, style)`` for every module of ``root`` a pattern matches (first pattern
    wins; ``""`` is ``root`` itself). Raises if a pattern matches nothing (a plan written for another layout)."""
    named = list(root.named_modules())
    out: list[tuple[str, nn.Module, str]] = []
    taken: set[str] = set()
    for pattern, style in plan.items():
        hits = [(n, m) for n, m in named if (n or not pattern) and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"parallel plan pattern {pattern!r} matches no module of {type(root).__name__}"
            )
        for name, module in hits:
            if name not in taken:
                taken.add(name)
                out.append((name, module, style))
    return out


def _style(
    kind: str, name: str, arg: Any, extra: Mapping[str, Callable[[Any], Any]] | None = None
) -> Any:
    known = {**_STYLES[kind], **(extra or {})}
    if name not in known:
        raise KeyError(f"unknown {kind} style {name!r}; registered: {', '.join(sorted(known))}")
    return known[name](arg)


def apply_tp(
    root: nn.Module,
    plan: Mapping[str, str],
    tp_mesh: DeviceMesh,
    *,
    styles: Mapping[str, Callable[[Any], Any]] | None = None,
) -> list[str]:
    """Tensor parallelism from ``plan`` on the 1-D ``tp_mesh``; returns the modules' names.

    ``styles``: ``{name: factory(tp_mesh) -> style}`` the plan may name besides the registered
    ones (a model family's own, e.g. lmms_models' ``ModelSpec.plan_styles()``); a style object
    either is a DTensor ``ParallelStyle`` or has ``apply(module)``. Column/row-wise Linears must
    divide evenly (checked here, with the module named)."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    tp = tp_mesh.size()
    dtensor_plan: dict[str, Any] = {}
    names = []
    for name, module, style in match_plan(root, plan):
        obj = _style("tp", style, tp_mesh, styles)
        if isinstance(obj, ParallelStyle):
            if isinstance(module, nn.Linear):
                dim = module.out_features if style == "colwise" else module.in_features
                if dim % tp:
                    raise ValueError(
                        f"{name}: {style} over tp={tp} needs {dim} features divisible by {tp}"
                    )
            dtensor_plan[name] = obj
        else:
            obj.apply(module)
        names.append(name)
    if dtensor_plan:
        parallelize_module(root, tp_mesh, dtensor_plan)
    return names


def apply_ep(root: nn.Module, plan: Mapping[str, str], group: dist.ProcessGroup) -> list[str]:
    """Expert parallelism from ``plan`` over ``group``; returns the modules' names."""
    names = []
    for name, module, style in match_plan(root, plan):
        _style("ep", style, group).apply(module)
        names.append(name)
    return names
