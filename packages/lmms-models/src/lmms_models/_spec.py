"""ModelSpec: everything the engine needs to know about one model family, on top of the upstream
transformers implementation (which stays untouched: no copied forwards).

A family subclasses :class:`ModelSpec`, sets a few class attributes (the transformers classes, the
processor family, the number of position rows) and provides a tiny config; the shared logic here
builds the model, runs the packed forward and answers the questions of lmms-parallel and the
trainer (which blocks to shard, which module to slice for sequence parallel, FLOPs).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._attention import set_attention, text_attention_kwargs
from ._data_plan import DataPlan, TokenRows
from ._rows import IGNORE_INDEX, batch_shift_labels, shift_labels_packed, to_device
from ._spec_estimates import SpecEstimates

__all__ = ["IGNORE_INDEX", "ModelSpec", "shift_labels_packed", "to_device"]

#: Config keys lmms itself reads from a family's config (masked diffusion: attention made
#: bidirectional, the shifted layout of a dLLM export).
_LMMS_CONFIG_KEYS = ("is_causal", "lmms_diffusion_shift")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _deep_merge(out[k], v) if both else copy.deepcopy(v)
    return out


# Prepared masks for every layer type of the supported decoders: none (varlen attention takes the
# segments from cu_seqlens). Layers index it by their config's layer type.
_NO_MASKS = {"full_attention": None, "sliding_attention": None}


class ModelSpec(SpecEstimates):
    """Base class of the model families; instances live in :data:`lmms_models.MODEL_REGISTRY`.

    Class attributes a family sets:

    * ``config_class`` / ``model_class``: names in ``transformers`` (imported lazily).
    * ``processor_family``: key into lmms_data's processor registry.
    * ``position_rows``: 1 for text LMs (``position_ids [1, T]``), 4 for Qwen-VL
      (``[4, 1, T]``: per-sample text positions, then the 3 mRoPE rows).
    * ``media_keys``: batch entries passed to the model call (with a leading batch dim only for
      ``mm_token_type_ids``).
    * ``mask_mapping``: the upstream decoder accepts ``attention_mask`` as a prepared
      ``{layer type: mask}`` mapping (its ``isinstance(attention_mask, dict)`` branch). The packed
      forward then passes ``None`` masks that way, which skips transformers' mask preparation: from
      ``position_ids`` alone it looks for packed sequences and reads the answer on the host, one
      device synchronisation per forward, for a mask that varlen attention never uses.
    * ``host_keys``: batch entries the forward wants on the host (a caller that moves batches to
      the device leaves them there): small metadata such as ``image_grid_thw`` from which the
      family derives its vision inputs without a device synchronisation (:meth:`media_context`),
      or ``mm_token_type_ids`` from which it places the media features (:meth:`merge_media`).
    * ``presets``: real-size configs (dicts) by name, e.g. ``"3b"``; random weights for benchmarks.
    """

    name: str = ""
    processor_family: str = ""
    config_class: str = ""
    model_class: str = ""
    position_rows: int = 1
    media_keys: tuple[str, ...] = ()
    host_keys: tuple[str, ...] = ()
    mask_mapping: bool = False
    presets: dict[str, dict[str, Any]] = {}  # noqa: RUF012 (read-only class table)
    #: ``model_type`` values of checkpoint folders (their config.json) that this family loads
    #: besides its own name, e.g. flash-linear-attention's ``gated_deltanet`` or an Omni
    #: ``*_thinker`` folder: the trainer resolves such a folder to this family.
    folder_model_types: tuple[str, ...] = ()
    #: diffusers' ``_class_name`` values of checkpoint folders this family loads (their
    #: config.json has no ``model_type``), e.g. Wan's ``WanTransformer3DModel``.
    folder_class_names: tuple[str, ...] = ()
    #: lmms-engine's names for this family, read by ``lmms-train convert-config``: its
    #: ``model_type`` values, each with the objective it implies (None: the family's default),
    #: and its ``dataset_type`` values whose records are chat records (``dataset_type: chat``).
    engine_model_types: dict[str, str | None] = {}  # noqa: RUF012
    engine_dataset_types: tuple[str, ...] = ()
    #: Parallel plans as data, ``{module pattern: style}`` relative to :meth:`plan_root`, applied
    #: by lmms_parallel's ``apply_tp`` / ``apply_ep`` (lmms_models._plans, EXPERTS_EP_PLAN).
    #: Empty: the family does not support that kind of parallelism.
    tp_plan: dict[str, str] = {}  # noqa: RUF012
    ep_plan: dict[str, str] = {}  # noqa: RUF012
    #: The LM head's TP plan, relative to the whole model (applied with ``tp_plan`` for the
    #: next-token loss; lmms_models._plans.LM_HEAD_TP_PLAN). Empty: the head stays replicated.
    tp_head_plan: dict[str, str] = {"lm_head": "vocab_parallel"}  # noqa: RUF012
    #: ``tp_plan`` with sequence-parallel norms (``trainer_args.tp_sequence_parallel``; empty:
    #: not supported by the family). lmms_models._plans.QWEN2_TP_SP_PLAN / QWEN3_TP_SP_PLAN.
    tp_sp_plan: dict[str, str] = {}  # noqa: RUF012
    #: Ulysses sequence parallel as a plan over the whole model, for a family whose tokens are
    #: not split at the text decoder's inputs (lmms_parallel's ``apply_sp`` styles: e.g.
    #: ``sp_split_tokens`` on the first block, ``sp_gather_tokens`` after the last). Empty: the
    #: default ``SequenceParallel`` on :meth:`sp_slice_module` (:meth:`install_sp`).
    sp_plan: dict[str, str] = {}  # noqa: RUF012
    #: The objective a run of this family takes by default (``model_config.objective``), and
    #: the options the family gives it when chosen (under ``objective_args``), e.g. Wan's
    #: rectified-flow parameterisation.
    default_objective: str = "causal_lm"
    objective_defaults: dict[str, Any] = {}  # noqa: RUF012
    #: What ``trainer_args.use_liger_kernel`` patches with Liger's kernels: the fields of
    #: ``lmms_kernels.LigerPlan`` (``rms_norm`` / ``mlp``: module class names, ``rms_offset``,
    #: ``rms_casting``, ``mlp_optional``) for ``lmms_kernels.apply_liger``. Empty: nothing.
    liger_plan: dict[str, Any] = {}  # noqa: RUF012
    #: ``dataset_config.generate_synthetic.kind`` when the config gives none ("": chosen from
    #: the ``media_keys``: text, vl, audio or omni).
    synthetic_kind: str = ""

    # ---------------------------------------------------------------- configs
    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        """A small HF config dict for tests (vocab 1024, special token ids inside it)."""
        raise NotImplementedError(f"{type(self).__name__} defines no tiny_config")

    def preset(self, name: str) -> dict[str, Any]:
        """A copy of the real-size config dict ``name`` (see ``presets``)."""
        if name not in self.presets:
            raise KeyError(
                f"{self.name} has no preset {name!r}; presets: {', '.join(self.presets) or 'none'}"
            )
        return copy.deepcopy(self.presets[name])

    def make_config(self, config: dict[str, Any]) -> Any:
        """A transformers config object from a plain dict (``model_type`` may be present)."""
        import transformers

        cfg = dict(config)
        model_type = cfg.pop("model_type", None)
        cls = getattr(transformers, self.config_class)
        if model_type is not None and model_type != cls.model_type:
            raise ValueError(
                f"config says model_type={model_type!r} but spec {self.name!r} builds {cls.model_type!r}"
            )
        return cls(**cfg)

    def config_keys(self) -> dict[str, Any]:
        """Every key a config dict of this family may set, as a key tree (``{key: None or the
        tree of a nested config}``, :func:`lmms_models._config_keys.key_tree`): what the
        family's config object reads, found on its tiny config. Callers reject other keys."""
        from ._config_keys import key_tree

        tree = key_tree(self.make_config(self.tiny_config()))
        return {**dict.fromkeys(_LMMS_CONFIG_KEYS), **tree}

    def unknown_config_keys(
        self, config: dict[str, Any], base: dict[str, Any] | None = None
    ) -> list[str]:
        """The keys of ``config`` (a user's dict over ``base``, e.g. the tiny config) that this
        family's config ignores, each as ``'key' (did you mean 'x'?)``: not in
        :meth:`config_keys`, and the built config is the same without them."""
        from ._config_keys import ignored_keys

        merged = _deep_merge(base or {}, config)
        return ignored_keys(self.make_config, self.config_keys(), merged, config)

    @staticmethod
    def text_config(config: Any) -> Any:
        """The language model's config (the config itself for text-only families)."""
        return getattr(config, "text_config", None) or config

    # ---------------------------------------------------------------- building
    def build(
        self,
        *,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "auto",
        vision_attn_backend: str | None = None,
    ) -> nn.Module:
        """Build the model from a config dict, a local pretrained folder, or on meta.

        * ``config``: random init from the dict (``tiny_config()`` or a preset).
        * ``pretrained``: a local folder through the real ``from_pretrained`` (no hub access is
          attempted). With ``device="meta"`` only its config is read (weights are loaded later,
          e.g. broadcast from rank 0 by lmms-parallel).
        * ``attn_backend``: ``"eager"``/``"sdpa"`` keep upstream attention (reference runs); any
          other value registers lmms varlen attention (see :func:`set_attention`);
          ``vision_attn_backend`` gives the vision tower its own (default: the same).

        The module itself comes from :meth:`build_module`, which a family overrides when it is
        not ``transformers.<model_class>`` (a local class, fla's or diffusers' classes, another
        checkpoint layout).
        """
        if (config is None) == (pretrained is None):
            raise ValueError("give exactly one of config= or pretrained=")
        source = pretrained if config is None else config
        model = self.build_module(source, torch.device(device), dtype)  # type: ignore[arg-type]
        self.set_attention(model, backend=attn_backend, vision_backend=vision_attn_backend)
        return model

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """The module from ``source``, a config dict or a local folder (on ``meta`` only the
        folder's config is read, with the family's config class: no remote code, and folders of
        releases that reuse the family's layout, e.g. Dream, read as well), on ``device`` in
        ``dtype``; upstream SDPA until :meth:`set_attention` switches it."""
        import transformers

        from ._build import build_hf_style

        model_cls = getattr(transformers, self.model_class)
        config_cls = getattr(transformers, self.config_class)
        return build_hf_style(self.make_config, model_cls, config_cls, source, device, dtype)

    def set_attention(
        self,
        model: nn.Module,
        *,
        backend: str = "auto",
        wrapper: Callable[..., torch.Tensor] | None = None,
        vision_backend: str | None = None,
    ) -> dict[str, str]:
        """Switch the attention of both towers (see :func:`lmms_models.set_attention`)."""
        return set_attention(
            model,
            self.vision_tower(model),
            backend=backend,
            wrapper=wrapper,
            vision_backend=vision_backend,
        )

    def weights_file(self, path: str) -> str | Path:
        """The file of a ``load_from_pretrained_path`` folder that holds the trained module's
        weights (what rank 0 reads and broadcasts into the FSDP2 shards); default: the folder
        itself (every ``*.safetensors`` in it)."""
        return path

    def pretrained_weights(self, folder: str) -> str | dict[str, torch.Tensor]:
        """What rank 0 loads into the shards of a model built on meta: a path that
        lmms_parallel's ``load_full_state_dict`` reads (default: ``folder``), or the state dict
        itself when the family reads its release (e.g. an Omni thinker out of the full model)."""
        return folder

    def export_writer(self, model: nn.Module) -> Callable[..., Any] | None:
        """``writer(out_dir, state_dict=...)`` that writes an export folder of ``model`` in the
        family's own layout (handed to lmms_parallel's ``export_hf``); None (default): the
        model's transformers ``save_pretrained``."""
        return None

    def finish_export(self, out: str | Path, source: str | None) -> None:
        """After the trainer's HF export to ``out`` of a run that started from ``source`` (a
        ``load_from_pretrained_path`` folder, or None): rewrite the release's layout if the
        family has one (default: nothing)."""
        return None

    # ---------------------------------------------------------------- data
    def data_plan(self, model_config: Callable[[], dict[str, Any]]) -> DataPlan:
        """How this family's records become training rows (:mod:`lmms_models._data_plan`;
        lmms-train implements each plan): default :class:`TokenRows` of ``processor_family``.
        ``model_config()`` gives the model's config dict as built, for plans that derive from it.
        """
        return TokenRows()

    # ---------------------------------------------------------------- packed forward
    def packed_forward(
        self,
        model: nn.Module,
        batch: dict[str, Any],
        *,
        sp_group: Any = None,
        loss_backend: str = "auto",
    ) -> tuple[torch.Tensor, ...]:
        """Forward one packed row; return ``(loss_sum fp32 scalar, n_loss_tokens int64 scalar)``.

        The upstream base model runs on ``input_ids [1, T]`` with no attention mask,
        ``use_cache=False``, the pack's position ids and media tensors; the pack's ``cu_seqlens``
        reach the text decoder's attention as transformers' flash keyword arguments. The loss is
        ``lmms_kernels.fused_linear_cross_entropy`` on the last hidden state and the LM head weight,
        so ``[T, vocab]`` logits never exist (``loss_backend``: its ``backend``). Divide by the
        global token count outside.

        ``sp_group``: Ulysses sequence parallel. The caller has installed lmms_parallel's
        ``SequenceParallel`` hook on ``sp_slice_module`` (so the decoder sees this rank's slice of
        the row) and the Ulysses attention wrapper; the loss is taken on the matching slice of the
        labels and its sum and count are reduced over the group (gradients pass through unchanged).

        ``batch["loss_rows"]`` (optional, int64 ``[T_l]``: the rows whose shifted label is not
        ignored, computed on the host by the caller, ``lmms_kernels.labelled_rows``) restricts the
        LM head and the loss to those rows (same loss and gradients, fewer FLOPs); under SP it is
        not used (each rank takes its slice of the full rows).

        A family may add a per-token loss term (e.g. an MoE router's auxiliary loss) through
        :meth:`extra_loss_inputs` and :meth:`extra_loss`: the term is multiplied by the (local)
        loss-token count and added to ``loss_sum`` before the SP reduction.
        """
        from lmms_kernels import fused_linear_cross_entropy

        from ._plans import head_cross_entropy

        head = self.lm_head(model)
        dev = head.weight.device
        cu = batch["cu_seqlens"].to(dev, torch.int32, non_blocking=True)  # [n+1]
        shift = batch_shift_labels(batch, cu, dev)  # [T]
        hidden, out = self.packed_hidden(model, batch)  # [T(/sp), H]
        extra = self.extra_loss(model, out, batch, sp_group=sp_group)  # per-token term or None
        if sp_group is None:  # `loss_rows` [T_l]: the LM head on the labelled rows only
            loss_sum, n = head_cross_entropy(  # a vocab-parallel (TP) head: lmms-parallel's loss
                hidden, head, shift, backend=loss_backend, rows=batch.get("loss_rows")
            )
            return (loss_sum, n) if extra is None else (loss_sum + extra * n, n)
        from lmms_parallel import sp_reduce_loss, sp_shard_labels

        local = sp_shard_labels(shift, sp_group)  # [T_pad/sp], this rank's slice
        loss_sum, n = fused_linear_cross_entropy(
            hidden, head.weight, local, bias=head.bias, backend=loss_backend
        )
        if extra is not None:
            loss_sum = loss_sum + extra * n
        return sp_reduce_loss(loss_sum, n, sp_group)

    def packed_hidden(
        self, model: nn.Module, batch: dict[str, Any], *, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """The text decoder's last hidden states on one packed row, and the base model's output.

        Returns ``(hidden [T, H] (this rank's [T_pad/sp, H] slice under Ulysses SP), out)``, in the
        autocast dtype on CUDA. ``input_ids [T]`` replaces the batch's (a masked-diffusion
        objective feeds its noised row); everything else (positions, media, ``cu_seqlens``) comes
        from ``batch``. Objectives put their own loss on top (:mod:`lmms_models.objectives`).
        """
        head = self.lm_head(model)
        dev = head.weight.device
        ids = batch["input_ids"] if input_ids is None else input_ids
        input_ids = ids.to(dev, non_blocking=True).reshape(1, -1)  # [1, T]
        n_tokens = input_ids.shape[1]
        cu = batch["cu_seqlens"].to(dev, torch.int32, non_blocking=True)  # [n+1]
        max_len = int(batch["max_seqlen"])
        inputs: dict[str, Any] = {
            "input_ids": input_ids,
            "position_ids": self.pack_position_ids(batch, n_tokens, dev),
            "attention_mask": dict(_NO_MASKS) if self.mask_mapping else None,
            "use_cache": False,
        }
        inputs.update(self.media_inputs(batch, dev))
        inputs.update(self.extra_loss_inputs(model))
        flash_kwargs = {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max_len,
            "max_length_k": max_len,
        }
        with (
            text_attention_kwargs(self.sp_slice_module(model), **flash_kwargs),
            self.media_context(model),
        ):
            out = self.forward_module(model)(**self.merge_media(model, inputs))
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])  # [T(/sp), H]
        if hidden.is_cuda and torch.is_autocast_enabled("cuda"):
            hidden = hidden.to(torch.get_autocast_dtype("cuda"))  # upstream norms return fp32
        return hidden, out

    def extra_loss_inputs(self, model: nn.Module) -> dict[str, Any]:
        """Extra keyword arguments for the base model call of :meth:`packed_forward` (none)."""
        return {}

    def extra_loss(
        self, model: nn.Module, out: Any, batch: dict[str, Any], *, sp_group: Any = None
    ) -> torch.Tensor | None:
        """A per-token loss term added by :meth:`packed_forward` (fp32 scalar, or None: none).

        ``out`` is the base model's output on the row (this rank's slice under SP). The term is
        weighted by the loss-token count: ``loss_sum + term · n``.
        """
        return None

    def pack_position_ids(
        self, batch: dict[str, Any], n_tokens: int, device: torch.device
    ) -> torch.Tensor:
        """The pack's positions as the upstream model wants them: ``[1, T]`` or ``[R, 1, T]``."""
        pos = batch.get("position_ids")
        if pos is None:
            if self.position_rows != 1:
                raise ValueError(f"{self.name} needs position_ids [{self.position_rows}, T]")
            cu = batch["cu_seqlens"].long()
            lens = (cu[1:] - cu[:-1]).tolist()
            pos = torch.cat([torch.arange(n) for n in lens])
        pos = pos.to(device, non_blocking=True)
        if self.position_rows == 1:
            return pos.reshape(1, n_tokens)
        if pos.ndim == 3:
            pos = pos.reshape(pos.shape[0], n_tokens)
        if pos.ndim != 2 or pos.shape[0] != self.position_rows:
            raise ValueError(
                f"{self.name} needs position_ids [{self.position_rows}, T], got {tuple(pos.shape)}"
            )
        return pos.unsqueeze(1)  # [R, 1, T]

    def media_inputs(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """Media entries of the batch for the model call (only those present), on ``device``
        except the ``host_keys``, which stay where they are."""
        out: dict[str, Any] = {}
        for key in self.media_keys:
            value = batch.get(key)
            if value is None:
                continue
            if key not in self.host_keys:
                value = to_device(value, device)
            out[key] = value.reshape(1, -1) if key == "mm_token_type_ids" else value
        return out

    def merge_media(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """The base model call's keyword arguments, possibly with the media already merged into
        ``inputs_embeds`` (default: unchanged; Qwen2.5-VL merges with host-known placeholder
        positions, :class:`lmms_models.QwenVLSpec`). Runs inside :meth:`media_context`."""
        return inputs

    def media_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context the packed forward runs the model in (default: none). Families whose
        ``host_keys`` stay on the host derive the inputs that need them here (Qwen-VL: a hook on
        the vision tower, :class:`lmms_models.QwenVLSpec`)."""
        return contextlib.nullcontext()

    def sample_position_ids(
        self, model: nn.Module, input_ids: torch.Tensor, **media: Any
    ) -> torch.Tensor:
        """One sample's position ids ``[R, L]`` (tests and benchmarks; at run time lmms-data makes
        them). Text LMs: ``arange(L)``."""
        return torch.arange(input_ids.shape[-1], device=input_ids.device)[None]

    # ---------------------------------------------------------------- hooks for lmms-parallel
    def base_model(self, model: nn.Module) -> nn.Module:
        """The upstream base model (``model.model``) whose forward returns hidden states."""
        return model.model

    def forward_module(self, model: nn.Module) -> nn.Module:
        """The module :meth:`packed_hidden` calls with :meth:`merge_media`'s keyword arguments
        (default: :meth:`base_model`; a family whose base model also computes logits may call
        its text model with the merged ``inputs_embeds`` instead)."""
        return self.base_model(model)

    def text_model(self, model: nn.Module) -> nn.Module:
        """The text decoder (embeddings, layers, final norm)."""
        base = self.base_model(model)
        return getattr(base, "language_model", base)

    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(self.text_model(model).layers)

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return getattr(self.base_model(model), "visual", None)

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        tower = self.vision_tower(model)
        return [] if tower is None else list(tower.blocks)

    def towers(self, model: nn.Module) -> dict[str, nn.Module | None]:
        """The model's towers by name, for per-tower choices (``model_config.lora.towers``):
        ``decoder`` (:meth:`text_model`) and ``vision`` (:meth:`vision_tower`; None: none).
        Audio families name their audio encoder ``audio``. Modules outside every tower (embeddings,
        LM head, projectors) are not part of any."""
        return {"decoder": self.text_model(model), "vision": self.vision_tower(model)}

    def vision_participation_outputs(self, model: nn.Module, out: Any) -> list[torch.Tensor] | None:
        """What a rank without media sums from the tower's output on the dummy input so that the
        same parameters get a gradient as on ranks with media (``outputs`` of
        lmms_parallel.VisionParticipation). None (default): every floating-point output."""
        return None

    def install_participation(self, model: nn.Module, device: Any) -> Any:
        """Make every rank run every tower in every step, in one order: the caller installs this
        when several ranks hold the model's sharded towers (FSDP2 gathers a tower's shards
        collectively, so a rank whose pack has no media runs the tower on a dummy input where its
        peers run it on theirs). Default: lmms_parallel's ``VisionParticipation`` on
        :meth:`sp_slice_module` for :meth:`vision_tower` (dummy from
        :meth:`dummy_vision_inputs`, outputs from :meth:`vision_participation_outputs`). Returns
        the handle (``.remove()``), or None without a tower. Model code never asks
        ``torch.distributed`` itself."""
        tower = self.vision_tower(model)
        if tower is None:
            return None
        from lmms_parallel import VisionParticipation

        def dummy() -> dict[str, Any]:
            return self.dummy_vision_inputs(model, device)

        def outputs(out: Any) -> list[torch.Tensor] | None:
            return self.vision_participation_outputs(model, out)

        return VisionParticipation(
            self.sp_slice_module(model), tower, dummy, outputs=outputs
        ).install()

    def vision_split_plan(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """How one call of the vision tower divides into items for the SP ranks
        (:class:`lmms_parallel.SplitVision`): a :class:`lmms_parallel.VisionSplitPlan`."""
        raise NotImplementedError(f"{self.name} does not say how to split its vision tower's work")

    def splits_vision(self) -> bool:
        """Whether :meth:`vision_split_plan` says how to share the tower's work over SP ranks
        (a family that defines it); otherwise the tower runs whole on every SP rank."""
        return type(self).vision_split_plan is not ModelSpec.vision_split_plan

    def block_classes(self, model: nn.Module) -> list[type[nn.Module]]:
        """Distinct classes of decoder and vision blocks (for FSDP wrapping / checkpointing)."""
        classes: list[type[nn.Module]] = []
        for block in self.decoder_blocks(model) + self.vision_blocks(model):
            if type(block) not in classes:
                classes.append(type(block))
        return classes

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        return [self.text_model(model).embed_tokens]

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def plan_root(self, model: nn.Module) -> nn.Module:
        """The module the TP and EP plans' patterns are relative to: the text decoder."""
        return self.text_model(model)

    def plan_styles(self) -> dict[str, Callable[[Any], Any]]:
        """TP styles this family's plans name besides lmms-parallel's registered ones:
        ``{name: factory(tp_mesh) -> style}`` (a style with ``apply(module)``), handed to
        ``lmms_parallel.apply_tp(..., styles=)`` (default: none)."""
        return {}

    def check_tp(self, config: Any, tp: int) -> None:
        """Raise (at start-up) unless this family's TP plan runs at degree ``tp``."""
        if not self.tp_plan:
            raise NotImplementedError(f"{self.name} has no tensor-parallel plan")
        from ._plans import check_tp_heads

        check_tp_heads(self.text_config(config), tp)

    def check_sp(self, config: Any, sp: int) -> None:
        """Raise (at start-up, before the model is built) unless this family runs Ulysses
        sequence parallel at degree ``sp``. Default: the text decoder's attention heads split
        over ``sp`` (``heads % sp == 0``; KV heads divisible by ``sp``, or fewer KV heads than
        ``sp`` with ``sp % kv == 0``, repeated as lmms_parallel's UlyssesAttention does).
        ``config`` None (not readable before the build): only whether the family runs SP."""
        if config is None:
            return
        text = self.text_config(config)
        heads = getattr(text, "num_attention_heads", None)
        if heads is None:
            return
        kv = getattr(text, "num_key_value_heads", None) or heads
        if heads % sp or (kv % sp if kv >= sp else sp % kv):
            raise ValueError(
                f"sp_ulysses_degree {sp} must divide the {heads} attention heads and the {kv} "
                "KV heads (or be a multiple of fewer KV heads): each SP rank attends with whole heads"
            )

    def objective_capabilities(self) -> frozenset[str]:
        """What this family offers training objectives, matched against an objective's
        ``requires`` before the model is built (:mod:`lmms_models.objectives`). Default:
        ``token_lm`` (a vocabulary and an LM head on packed token rows) and
        ``bidirectional_text`` (its text attention can be made non-causal)."""
        return frozenset({"token_lm", "bidirectional_text"})

    def sp_slice_module(self, model: nn.Module) -> nn.Module:
        """The module whose ``inputs_embeds``/``position_ids`` are sliced for Ulysses SP: the text
        decoder, called after the multimodal merge."""
        return self.text_model(model)

    def install_sp(self, model: nn.Module, sp_group: Any) -> Any:
        """Install Ulysses sequence parallel on ``model`` for ``sp_group`` (after the attention
        wrapper): the family's :attr:`sp_plan` applied by ``lmms_parallel.apply_sp`` (Wan: the
        video tokens; BAGEL: the decoder stack over a row of parts), else lmms_parallel's
        ``SequenceParallel`` hook on :meth:`sp_slice_module`. Returns the handle
        (``.remove()``)."""
        from lmms_parallel import SequenceParallel, apply_sp

        if self.sp_plan:
            return apply_sp(model, self.sp_plan, sp_group)
        return SequenceParallel(self.sp_slice_module(model), sp_group).install()

    def muon_adamw_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose matrices the Muon optimizer leaves to AdamW besides the embeddings and
        the LM head (default: none; e.g. BAGEL's modality projections)."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
