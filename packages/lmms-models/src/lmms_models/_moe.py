"""What the mixture-of-experts families share: the router's load-balancing loss in the packed
forward, fast experts through transformers' experts registry, the expert-parallel plan, and a
meter of the experts' load for the trainer's metrics.

Router auxiliary (load-balancing) loss: with ``output_router_logits=True`` in the text config the
packed forward asks the base model for its router logits (as upstream's ``*ForCausalLM`` /
``*ForConditionalGeneration`` do) and adds upstream's own ``load_balancing_loss_func`` on the
row's real tokens (the tail padding segment masked out) as

    loss_sum + router_aux_loss_coef · aux · n_loss_tokens

so that, once the trainer divides by the token count, one micro-batch gives exactly upstream's
``loss + coef · aux`` and several give the token-weighted mean of their aux terms. Under Ulysses
SP each rank takes aux over its own slice (see ``families/qwen3_moe``).
"""

from __future__ import annotations

import importlib
import re
import weakref
from typing import Any

import torch
from torch import nn

from ._capabilities import HasExperts

__all__ = [
    "EXPERTS_EP_PLAN",
    "ExpertLoadMeter",
    "MoESpecMixin",
    "expert_load_meter",
    "fuse_expert_weights",
]

#: Expert-parallel plan of the Qwen MoE decoders (Qwen3-MoE, Qwen3-VL-MoE, and the omni MoE
#: thinkers that reuse their blocks): module patterns relative to the text decoder -> style.
#: ``"experts"`` is lmms_parallel's style for transformers' 3-D experts
#: (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).
EXPERTS_EP_PLAN: dict[str, str] = {"layers.*.mlp.experts": "experts"}

_METERS: weakref.WeakKeyDictionary[nn.Module, ExpertLoadMeter] = weakref.WeakKeyDictionary()


class MoESpecMixin(HasExperts):
    """Mixed into a :class:`lmms_models.ModelSpec` of a family with top-k routed experts.

    ``aux_loss_module``: the transformers module (``transformers.models.<name>``) whose
    ``load_balancing_loss_func`` the family's upstream model uses.
    """

    aux_loss_module: str = ""
    ep_plan: dict[str, str] = EXPERTS_EP_PLAN
    tp_plan: dict[str, str] = {}  # noqa: RUF012  (sparse decoders scale with EP, not TP)
    tp_sp_plan: dict[str, str] = {}  # noqa: RUF012

    def pretrained_weights(self, folder: str) -> str | dict[str, torch.Tensor]:
        """The release's weights with per-expert matrices fused into transformers' 3-D experts
        (:func:`fuse_expert_weights`): a meta-device build (FSDP2, EP) loads them by name, where
        ``from_pretrained`` would convert them itself."""
        weights = super().pretrained_weights(folder)  # type: ignore[misc]
        if isinstance(weights, str):
            from lmms_parallel import read_safetensors

            weights = read_safetensors(weights)
        return fuse_expert_weights(weights)

    # ---------------------------------------------------------------- router aux loss
    def router_aux_enabled(self, model: nn.Module) -> bool:
        cfg = self.text_config(model.config)  # type: ignore[attr-defined]
        return bool(getattr(cfg, "output_router_logits", False))

    def extra_loss_inputs(self, model: nn.Module) -> dict[str, Any]:
        """``output_router_logits=True`` for the base model when the config enables the aux loss
        (or an :class:`ExpertLoadMeter` wants the aux value)."""
        return {"output_router_logits": True} if self.router_aux_enabled(model) else {}

    def extra_loss(
        self, model: nn.Module, out: Any, batch: dict[str, Any], *, sp_group: Any = None
    ) -> torch.Tensor | None:
        """``router_aux_loss_coef · aux`` (fp32 scalar) from the row's router logits, or None.

        ``aux`` is upstream's ``load_balancing_loss_func`` over the router logits of every MoE
        layer, masked to the pack's real tokens (``cu_seqlens[num_samples]``; the tail padding
        and, under SP, the SP padding are left out). Under SP the logits and the mask are this
        rank's slice. ``packed_forward`` multiplies the term by the loss-token count.
        """
        if not self.router_aux_enabled(model):
            return None
        router_logits = getattr(out, "router_logits", None)  # per MoE layer [T(/sp), E]
        if not router_logits:
            return None  # no MoE layer (mlp_only_layers / decoder_sparse_step)
        upstream = importlib.import_module(
            f"transformers.models.{self.aux_loss_module}.modeling_{self.aux_loss_module}"
        )
        cfg = self.text_config(model.config)  # type: ignore[attr-defined]
        dev = router_logits[0].device
        n_tokens = batch["input_ids"].numel()
        cu = batch["cu_seqlens"]
        real_end = cu[int(batch.get("num_samples", cu.numel() - 1))]  # first padding position
        if real_end.device.type == "cpu":
            real_end = int(real_end)  # no device sync either way
        # Always a mask, even without padding: upstream's unmasked path in transformers 5.17
        # counts with bincount (a host sync on GPU); the masked one uses scatter_add.
        real = (torch.arange(n_tokens, device=dev) < real_end).long()  # [T]
        if sp_group is not None:
            from lmms_parallel import sp_shard_labels

            real = sp_shard_labels(real, sp_group)  # [T_pad/sp]; the SP padding reads -100
        mask = (real > 0).float().reshape(1, -1)  # [1, T(/sp)]
        if mask.shape[1] != router_logits[0].shape[0]:
            raise ValueError(
                f"router logits cover {router_logits[0].shape[0]} tokens, the row's mask "
                f"{mask.shape[1]}: is the SequenceParallel hook installed iff sp_group is given?"
            )
        aux = upstream.load_balancing_loss_func(
            tuple(router_logits), cfg.num_experts, cfg.num_experts_per_tok, mask
        ).float()
        meter = _METERS.get(model)
        if meter is not None:
            meter.note_aux(aux)
        coef = getattr(model, "router_aux_loss_coef", None)
        if coef is None:
            coef = cfg.router_aux_loss_coef
        return coef * aux

    # ---------------------------------------------------------------- modules
    def moe_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The sparse MLP blocks (``layer.mlp`` with ``experts`` and ``gate``), in layer order."""
        blocks = self.decoder_blocks(model)  # type: ignore[attr-defined]
        return [b.mlp for b in blocks if hasattr(b.mlp, "experts")]

    def router_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m.gate for m in self.moe_blocks(model)]

    def experts_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m.experts for m in self.moe_blocks(model)]

    def set_experts(self, model: nn.Module, backend: str = "grouped") -> str:
        """Choose the experts' implementation: ``"grouped"`` (lmms_kernels' grouped GEMMs; the
        default of lmms runs), ``"loop"`` (lmms_kernels' plain-torch reference), or any name in
        transformers' experts registry (``"eager"``: upstream's per-expert loop,
        ``"grouped_mm"``, ...). Returns the registered name now in the text config."""
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        known = ["grouped", "loop", "eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]
        if backend not in known:
            raise ValueError(f"unknown experts implementation {backend!r}; known: {known}")
        if backend in ("grouped", "loop"):
            from lmms_kernels import register_experts

            name = register_experts(
                f"lmms_experts_{backend}", backend="auto" if backend == "grouped" else "loop"
            )
        else:
            name = backend
        cfg = self.text_config(model.config)  # type: ignore[attr-defined]
        cfg._experts_implementation = name
        for module in self.experts_modules(model):
            module.config._experts_implementation = name
        return name


class ExpertLoadMeter:
    """Counts the tokens each expert of each MoE layer receives, on the device (no host read
    until :meth:`take`), and the router aux loss of every packed forward.

    ``take()`` returns ``[aux_sum, n_forwards, counts [L·E]...]`` as one fp32 tensor that the
    trainer reduces over ranks with its loss; :func:`load_metrics` turns that into
    ``moe/aux_loss`` (mean per forward), ``moe/load_max_over_mean`` (mean over layers of the
    busiest expert's tokens over the mean expert's), ``moe/load_max_over_mean_worst`` (the
    worst layer) and ``moe/dead_experts`` (fraction of experts that got no token): a router
    that collapses shows as a growing ratio and dead experts. Recomputation under activation
    checkpointing is not counted twice.
    """

    def __init__(self, spec: MoESpecMixin, model: nn.Module) -> None:
        routers = spec.router_modules(model)
        self.n_layers = len(routers)
        cfg = spec.text_config(model.config)  # type: ignore[attr-defined]
        self.n_experts = int(cfg.num_experts)
        self._counts: torch.Tensor | None = None  # [L, E] int64
        self._aux: torch.Tensor | None = None
        self._forwards = 0
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]
        _METERS[model] = self
        self._model = weakref.ref(model)

    def _hook(self, layer: int) -> Any:
        def hook(_mod: nn.Module, _args: Any, out: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # recomputation inside backward (activation checkpointing)
            idx = next(
                t
                for t in reversed(out)
                if isinstance(t, torch.Tensor) and not t.is_floating_point()
            )  # [T, k] chosen experts
            flat = idx.reshape(-1)
            if self._counts is None or self._counts.device != flat.device:
                self._counts = torch.zeros(
                    self.n_layers, self.n_experts, dtype=torch.int64, device=flat.device
                )
            self._counts[layer].scatter_add_(0, flat, torch.ones_like(flat))

        return hook

    def note_aux(self, aux: torch.Tensor) -> None:
        aux = aux.detach().float()
        self._aux = aux if self._aux is None else self._aux + aux
        self._forwards += 1

    def take(self, device: torch.device) -> torch.Tensor:
        """``[aux_sum, n_aux, counts...]`` fp32 on ``device`` since the last call; resets."""
        counts = (
            self._counts.float().reshape(-1)
            if self._counts is not None
            else torch.zeros(self.n_layers * self.n_experts, device=device)
        )
        aux = self._aux if self._aux is not None else torch.zeros((), device=device)
        head = torch.stack([aux.to(device), torch.tensor(float(self._forwards), device=device)])
        self._counts, self._aux, self._forwards = None, None, 0
        return torch.cat([head, counts.to(device)])

    def summarize(self, raw: torch.Tensor) -> torch.Tensor:
        """``[aux_sum, n_aux, load_max_over_mean, ..._worst, dead_experts]`` on the device from a
        :meth:`take` result (after the trainer sums it over ranks): five scalars instead of
        ``L·E`` counts to bring to the host."""
        counts = raw[2:].reshape(self.n_layers, self.n_experts)
        ratio = counts.max(1).values / counts.mean(1).clamp_min(1e-9)  # [L]
        dead = (counts == 0).float().mean()
        return torch.stack([raw[0], raw[1], ratio.mean(), ratio.max(), dead])

    @staticmethod
    def named(summary: list[float]) -> dict[str, float]:
        """The metrics of a :meth:`summarize` result read on the host."""
        aux_sum, n_aux, ratio, worst, dead = summary
        out = {
            "moe/load_max_over_mean": ratio,
            "moe/load_max_over_mean_worst": worst,
            "moe/dead_experts": dead,
        }
        if n_aux > 0:
            out["moe/aux_loss"] = aux_sum / n_aux
        return out

    def load_metrics(self, values: list[float]) -> dict[str, float]:
        """The metrics of a :meth:`take` result (possibly summed over ranks), read on the host."""
        aux_sum, n_aux = values[0], values[1]
        counts = torch.tensor(values[2:]).reshape(self.n_layers, self.n_experts)
        mean = counts.mean(1).clamp_min(1e-9)
        ratio = counts.max(1).values / mean  # [L]
        out = {
            "moe/load_max_over_mean": float(ratio.mean()),
            "moe/load_max_over_mean_worst": float(ratio.max()),
            "moe/dead_experts": float((counts == 0).float().mean()),
        }
        if n_aux > 0:
            out["moe/aux_loss"] = aux_sum / n_aux
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        model = self._model()
        if model is not None:
            _METERS.pop(model, None)


def expert_load_meter(model: nn.Module) -> ExpertLoadMeter | None:
    """The :class:`ExpertLoadMeter` installed on ``model``, if any."""
    return _METERS.get(model)


_EXPERT_KEY = re.compile(
    r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert release keys (``...experts.<e>.{gate,up,down}_proj.weight``: Qwen3-MoE's and
    Qwen3.5-MoE's published layout, and what transformers 5 saves for them) -> the 3-D experts
    ``...experts.gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows) and
    ``...experts.down_proj [E, H, I]``. A state dict without such keys comes back as it is."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m["base"], {}).setdefault(m["proj"], {})[int(m["e"])] = value
    for base, projs in groups.items():
        n = 1 + max(max(p) for p in projs.values())
        if any(
            sorted(projs.get(p, {})) != list(range(n))
            for p in ("gate_proj", "up_proj", "down_proj")
        ):
            raise KeyError(f"{base}: the release names only some experts' gate/up/down weights")
        gate, up, down = projs["gate_proj"], projs["up_proj"], projs["down_proj"]
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([down[e] for e in range(n)])
    return out
