"""DiffusionSpec: the ModelSpec of a diffusion transformer (a denoiser of latents), trained with
the ``flow_matching`` objective instead of a packed language-model forward.

A *latent batch* (what the data side yields for these families; one shape per batch, so
resolution/frame buckets never mix) is a dict:

| key | shape | meaning |
| --- | --- | --- |
| ``latents`` | ``[B, C, H, W]`` / ``[B, C, F, H, W]`` | VAE latents (precomputed), or |
| ``pixel_values`` | ``[B, 3, H, W]`` / ``[B, 3, F, H, W]`` in [-1, 1] | media to encode on the fly |
| ``class_labels`` | ``[B]`` int64 | SiT's condition |
| ``text_embeds``, ``text_mask`` | ``[B, L, D]``, ``[B, L]`` | Wan's condition (precomputed), or |
| ``input_ids``, ``attention_mask`` | ``[B, L]`` | text to encode on the fly |
| ``noise_seed`` | ``[B]`` int64 | seeds of each sample's noise/time/CFG draws (from the record) |
| ``cu_seqlens``, ``num_samples`` | ``[B+1]``, int | latent tokens per sample (FLOPs, throughput) |
| ``num_loss_tokens`` | int | ``B``: the flow-matching loss is normalised per sample |

The spec answers the objective's questions (:meth:`diffusion_inputs`, :meth:`drop_condition`,
:meth:`denoise`) and the engine's (blocks to shard and checkpoint, FLOPs).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._capabilities import GeneratesLatents
from ._data_plan import LatentBatches
from ._flops import attention_flops
from ._spec import ModelSpec

__all__ = [
    "DiffusionSpec",
    "attach_encoder",
    "call_denoiser",
    "encoders_of",
    "get_encoder",
    "on_device",
    "place_encoders",
    "require_diffusers",
    "save_encoders",
]


def call_denoiser(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call the denoiser ``model`` (the root module). Inside the trainer's step the root's
    ``forward`` is temporarily the objective itself (``call_through_root``: FSDP2's root hooks
    fire around the whole step), so the class's own forward is called directly there; elsewhere
    the module is called normally (hooks included)."""
    if "forward" in model.__dict__:
        return type(model).forward(model, *args, **kwargs)
    return model(*args, **kwargs)


def require_diffusers() -> Any:
    """``import diffusers`` or an ImportError naming the extra that provides it."""
    try:
        import diffusers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "this model family needs diffusers: pip install 'lmms-models[diffusion]'"
        ) from exc
    return diffusers


class DiffusionSpec(ModelSpec, GeneratesLatents):
    """Base class of the diffusion-transformer families (``sit``, ``wan``).

    Frozen encoders are part of the model's config dict under ``encoder_classes``' keys (e.g.
    ``vae``, ``text_encoder``): a dict builds the encoder from that config (random weights from
    a fixed seed, the same on every rank: tiny runs), a string loads a local folder. They are
    attached with :func:`attach_encoder` (outside the trained module tree).
    """

    default_objective: str = "flow_matching"
    # name -> (library, model class, config class or "" for diffusers' own configs)
    encoder_classes: dict[str, tuple[str, str, str]] = {}  # noqa: RUF012
    placeable_encoders: tuple[str, ...] = ()  # encoders that encoder_blocks splits

    def split_encoders(self, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(transformer config, {encoder name: config dict or local path})``. Token ids that
        the trainer copies from a local tokenizer into tiny configs (``*_token_id``) concern the
        text encoder, not the denoiser, and are left out."""
        conf = {
            k: v
            for k, v in config.items()
            if k not in self.encoder_classes and not k.endswith("_token_id")
        }
        return conf, {k: config[k] for k in self.encoder_classes if config.get(k) is not None}

    def build_encoder(self, name: str, source: dict[str, Any] | str, seed: int = 0) -> nn.Module:
        """Encoder ``name`` from a config dict (seeded init) or a local folder."""
        import importlib

        lib, model_cls, config_cls = self.encoder_classes[name]
        if lib == "diffusers":
            require_diffusers()
        mod = importlib.import_module(lib)
        cls = getattr(mod, model_cls)
        if isinstance(source, str):
            return cls.from_pretrained(source, local_files_only=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + sum(map(ord, name)))
            if config_cls:
                return cls(getattr(mod, config_cls)(**source))
            return cls(**source)

    def encoder_blocks(self, name: str, encoder: nn.Module) -> list[nn.Module]:
        """The blocks of frozen encoder ``name`` that ``frozen_encoders: shard | offload`` shard
        or stream (:func:`place_encoders`); none (the default): the encoder stays replicated."""
        return []

    def attach_encoders(self, model: nn.Module, encoders: dict[str, Any]) -> None:
        """Attach the encoders *lazily*: each is built on first use (:func:`encoders_of`), so a
        model built on the meta device (under ``lmms_parallel.meta_init``) still gets real,
        identical encoders on every rank, and runs that read precomputed latents never build
        them."""
        pending = model.__dict__.setdefault(_PENDING, {})
        for name, source in encoders.items():
            pending[name] = functools.partial(self.build_encoder, name, source)

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """The denoiser from a config dict (:meth:`new_denoiser`) or a local folder
        (:meth:`pretrained_parts`; :meth:`load_denoiser`, on ``meta`` only its config is read),
        its encoders attached lazily (:meth:`attach_encoders`)."""
        if isinstance(source, str) and device.type != "meta":
            folder, encoders = self.pretrained_parts(source)
            model = self.load_denoiser(folder)  # CPU, float32
            model = model.to(device) if dtype == torch.float32 else model.to(device, dtype)
        else:
            config = self.pretrained_config(source) if isinstance(source, str) else source
            model = self.new_denoiser(config, device)
            encoders = self.split_encoders(config)[1]
            model = model if dtype == torch.float32 else model.to(dtype)
        self.attach_encoders(model, encoders)
        return model

    def new_denoiser(self, config: dict[str, Any], device: torch.device) -> nn.Module:
        """The denoiser of a config dict (encoder keys included), randomly initialised on
        ``device`` in float32."""
        raise NotImplementedError(f"{self.name}: no denoiser class")

    def load_denoiser(self, folder: str) -> nn.Module:
        """The denoiser of a local model folder, on the CPU in float32."""
        raise NotImplementedError(f"{self.name}: no denoiser class")

    def pretrained_parts(self, path: str) -> tuple[str, dict[str, str]]:
        """``(transformer folder, {encoder: folder})`` of a local checkpoint: a diffusers
        pipeline layout (``transformer/``, ``vae/``, ``text_encoder/``) or a bare model folder."""
        root = Path(path)
        folder = root / "transformer" if (root / "transformer" / "config.json").is_file() else root
        enc = {
            n: str(root / n) for n in self.encoder_classes if (root / n / "config.json").is_file()
        }
        return str(folder), enc

    def pretrained_config(self, path: str) -> dict[str, Any]:
        """The config dict of a local checkpoint, its encoders as folder paths."""
        folder, encoders = self.pretrained_parts(path)
        conf = json.loads((Path(folder) / "config.json").read_text())
        return {**{k: v for k, v in conf.items() if not k.startswith("_")}, **encoders}

    def media_factors(self, config: dict[str, Any]) -> tuple[int, int, int | None]:
        """``(temporal, spatial, latent channels)`` from media to latents under the config's VAE
        (``(1, 1, None)`` without one: pixel space or precomputed latents)."""
        vae = config.get("vae")
        if vae is None:
            return 1, 1, None
        if isinstance(vae, str):
            vae = json.loads((Path(vae) / "config.json").read_text())
        return self.vae_factors(vae)

    def vae_factors(self, vae: dict[str, Any]) -> tuple[int, int, int]:
        """``(temporal, spatial, latent channels)`` of the family's VAE from its config dict."""
        raise NotImplementedError(f"{self.name}: no VAE")

    def num_classes(self, config: dict[str, Any]) -> int | None:
        """How many class labels the model embeds (a label must lie in ``[0, n)``); None: the
        family takes no class labels (text-conditioned)."""
        return None

    def tokens_fn(self, config: dict[str, Any]) -> Any:
        """``shape -> tokens``: transformer tokens of a sample whose batch entry (pixels, or
        latents when the shape's channels are the VAE's) has ``shape`` (no batch dim)."""
        conf, _ = self.split_encoders(config)
        hf = self.make_config(conf)
        ft, fs, z = self.media_factors(config)

        def fn(shape: tuple[int, ...]) -> int:
            if z is not None and shape[0] == 3:  # pixels through the VAE
                dims = [1 + (d - 1) // ft for d in shape[1:-2]] + [d // fs for d in shape[-2:]]
                shape = (z, *dims)
            return self.tokens_per_sample(hf, shape)

        return fn

    def data_plan(self, model_config: Callable[[], dict[str, Any]]) -> LatentBatches:
        """Latent batches (lmms_data's latent loader) with :meth:`tokens_fn` and
        :meth:`num_classes` of the model's config."""
        config = model_config()
        return LatentBatches(tokens_fn=self.tokens_fn(config), num_classes=self.num_classes(config))

    # ---------------------------------------------------------------- objective hooks
    def diffusion_inputs(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """``(x1, condition)``: clean latents ``[B, ...]`` (fp32) and the family's condition, on
        the model's device (media and text encoded by the attached frozen encoders)."""
        device = next(model.parameters()).device
        return self.encode_batch(encoders_of(model), batch, device)

    def encode_batch(
        self, encoders: dict[str, nn.Module], batch: dict[str, Any], device: Any
    ) -> tuple[torch.Tensor, Any]:
        """:meth:`diffusion_inputs` with explicit encoders (also the precompute stage's)."""
        raise NotImplementedError

    def batch_latents(
        self, encoders: dict[str, nn.Module], batch: dict[str, Any], device: Any
    ) -> torch.Tensor:
        """The batch's ``latents`` in float32 on ``device``, or its ``pixel_values`` (in [-1, 1])
        through the VAE (:meth:`encode_pixels`)."""
        if "latents" in batch:
            return batch["latents"].to(device, torch.float32)
        vae = on_device(encoders, "vae", device)
        return self.encode_pixels(vae, batch["pixel_values"].to(device, torch.float32))

    def encode_pixels(self, vae: nn.Module | None, pixels: torch.Tensor) -> torch.Tensor:
        """The latents of ``pixels`` under the frozen ``vae`` (None: the config has none)."""
        raise NotImplementedError

    def drop_condition(self, model: nn.Module, cond: Any, drop: torch.Tensor) -> Any:
        """The condition with samples ``drop [B]`` replaced by the null condition (CFG)."""
        raise NotImplementedError

    def null_condition(self, model: nn.Module, batch_size: int, device: Any) -> Any:
        """The unconditional condition for ``batch_size`` samples (sampling with guidance)."""
        raise NotImplementedError

    def denoise(
        self,
        model: nn.Module,
        x_t: torch.Tensor,  # [B, ...] noised latents
        timestep: torch.Tensor,  # [B] what the network takes as its time input
        cond: Any,
    ) -> torch.Tensor:
        """The network's prediction ``[B, ...]`` (same shape as ``x_t``), single-device: under
        sequence parallel the family's :attr:`sp_plan` splits and gathers its tokens."""
        raise NotImplementedError

    def tokens_per_sample(self, config: Any, latent_shape: Sequence[int]) -> int:
        """Transformer tokens of one sample with latents of ``latent_shape`` (no batch dim)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- engine hooks
    def packed_forward(
        self, model: nn.Module, batch: dict[str, Any], *, sp_group: Any = None,
        loss_backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(loss_sum, count)`` of one batch under the family's own objective
        (:attr:`default_objective` with :attr:`objective_defaults`, draws from seed 0, step 0):
        a diffusion transformer has no language-model head, its packed forward is its training
        loss. Training runs take the objective itself (its seeds follow the step)."""
        from .objectives import ObjectiveContext, get_objective

        objective = get_objective(self.default_objective, **self.objective_defaults)
        ctx = ObjectiveContext(sp_group=sp_group, loss_backend=loss_backend)
        out = objective.loss(self, model, batch, ctx)
        return out.loss_sum, torch.as_tensor(out.count)

    def set_attention(self, model: nn.Module, **_: Any) -> dict[str, str]:
        return {}  # SDPA on dense [B, N] tokens: one shape per batch, no varlen needed

    def base_model(self, model: nn.Module) -> nn.Module:
        return model

    def text_model(self, model: nn.Module) -> nn.Module:
        return model

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return None

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        return []

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        return []

    def sp_slice_module(self, model: nn.Module) -> nn.Module:
        return model

    def config_keys(self) -> dict[str, Any]:
        """The denoiser's keys and the frozen encoders' (a config dict or a local folder)."""
        return {**super().config_keys(), **dict.fromkeys(self.encoder_classes)}

    def check_sp(self, config: Any, sp: int) -> None:
        """No sequence-parallel path without an :attr:`sp_plan` (a family that splits its tokens
        states one, and overrides this check with its own conditions)."""
        if not self.sp_plan:
            raise NotImplementedError(
                f"{self.name} has no sequence-parallel path: set trainer_args.sp_ulysses_degree: 1"
            )

    def install_sp(self, model: nn.Module, sp_group: Any) -> Any:
        """The family's :attr:`sp_plan` (lmms_parallel.apply_sp); there is no text decoder whose
        inputs the default would slice."""
        if not self.sp_plan:
            raise NotImplementedError(f"{self.name} has no sequence-parallel plan (sp_plan)")
        return super().install_sp(model, sp_group)

    def objective_capabilities(self) -> frozenset[str]:
        """A denoiser of latents: flow matching, not a token objective."""
        return frozenset({"latent_denoiser"})

    # ---------------------------------------------------------------- FLOPs
    def matmul_params(self, config: Any) -> int:
        """Parameters in a matmul per *token* (per-sample conditioning MLPs excluded)."""
        raise NotImplementedError

    def attention_shape(self, config: Any) -> tuple[int, int]:
        """``(layers, heads * head_dim)`` of the token self-attention."""
        raise NotImplementedError

    def extra_flops(self, config: Any, seq_lens: Sequence[int]) -> float:
        """FLOPs besides the token matmuls and self-attention (e.g. Wan's cross-attention)."""
        return 0.0

    def lm_flops(self, config: Any, seq_lens: Sequence[int], *, causal_half: bool = False) -> float:
        """Training FLOPs of the denoiser on samples of ``seq_lens`` tokens (bidirectional)."""
        layers, width = self.attention_shape(config)
        dense = 6.0 * self.matmul_params(config) * sum(seq_lens)
        return dense + attention_flops(layers, width, seq_lens) + self.extra_flops(config, seq_lens)


# ------------------------------------------------------------------------------ frozen encoders
_FROZEN = "_lmms_frozen_encoders"
_PENDING = "_lmms_pending_encoders"


def attach_encoder(model: nn.Module, name: str, encoder: nn.Module) -> None:
    """Attach a frozen encoder (VAE, text encoder) to ``model`` *outside* its module tree: it is
    not trained, not in the model's state dict, checkpoints or FSDP units, and follows the model's
    device on first use (:func:`get_encoder`). Its parameters are frozen and it runs in eval."""
    encoder.requires_grad_(False).eval()
    model.__dict__.setdefault(_FROZEN, {})[name] = encoder


def encoders_of(model: nn.Module) -> dict[str, nn.Module]:
    """The frozen encoders attached to ``model`` (name -> module; lazily attached ones are
    built here, once, and placed as :func:`place_encoders` asked)."""
    placement = model.__dict__.get(_PLACEMENT)
    for name, build in model.__dict__.pop(_PENDING, {}).items():
        enc = build()
        enc.__dict__[_BUILD] = build  # export rebuilds a placed encoder's full weights from it
        if placement is not None:
            _place(enc, name, **placement)
        attach_encoder(model, name, enc)
    return dict(model.__dict__.get(_FROZEN, {}))


FROZEN_ENCODER_MODES = ("replicate", "shard", "offload")
_PLACEMENT = "_lmms_encoder_placement"
_BUILD = "_lmms_build"
_PLACED = "_lmms_placed"  # set on an encoder that _place handled: on_device leaves it alone


def place_encoders(
    model: nn.Module,
    mode: str,
    *,
    blocks: Any,
    device: Any,
    mesh: Any = None,
    dtype: torch.dtype | None = None,
) -> None:
    """How the frozen encoders of ``model`` are held when they are built (lazily, on first use).

    ``mode``: ``replicate`` (a full copy on every rank's device, the default), ``shard`` (FSDP2
    over ``mesh``, one unit per block and the root, weights resharded after every forward: each
    rank holds ``1/N`` of the weights; every rank of ``mesh`` must encode together, which the
    trainer's lockstep micro-steps do) or ``offload`` (weights stay in CPU memory; each block is
    moved to ``device`` just before its forward and back after it; the parts outside the blocks,
    e.g. the embedding, live on ``device``). ``blocks(name, encoder)`` lists an encoder's blocks;
    an encoder without blocks (e.g. the VAE) stays replicated. ``dtype``: storage dtype of the
    placed encoders' weights (``None``: as built, fp32). No gradients in any mode."""
    if mode not in FROZEN_ENCODER_MODES:
        raise ValueError(f"frozen_encoders must be one of {FROZEN_ENCODER_MODES}, got {mode!r}")
    if mode == "shard" and mesh is None:
        raise ValueError("frozen_encoders: shard needs a device mesh (FSDP2 over the DP ranks)")
    if mode == "replicate":
        model.__dict__.pop(_PLACEMENT, None)
        return
    model.__dict__[_PLACEMENT] = dict(
        mode=mode, blocks=blocks, device=torch.device(device), mesh=mesh, dtype=dtype
    )
    for name, enc in model.__dict__.get(_FROZEN, {}).items():  # already built ones
        _place(enc, name, **model.__dict__[_PLACEMENT])


def _place(
    enc: nn.Module, name: str, *, mode: str, blocks: Any, device: torch.device, mesh: Any,
    dtype: torch.dtype | None,
) -> None:  # fmt: skip
    units = list(blocks(name, enc))
    if not units or getattr(enc, _PLACED, False):
        return
    if dtype is not None:
        enc.to(dtype)
    if mode == "shard":
        from lmms_parallel import apply_fsdp

        enc.to(device)
        apply_fsdp(enc, mesh, blocks=units, param_dtype=None, reshard_after_forward=True)
    else:  # offload: blocks on the CPU, streamed in around their forward
        enc.to(device)
        for block in units:
            block.to("cpu")
            block.register_forward_pre_hook(lambda mod, _a: mod.to(device) and None)
            block.register_forward_hook(lambda mod, _a, _o: mod.to("cpu") and None)
    enc.__dict__[_PLACED] = mode


def on_device(encoders: dict[str, nn.Module], name: str, device: Any) -> nn.Module | None:
    """``encoders[name]`` moved to ``device`` (once), or None. Encoders placed by
    :func:`place_encoders` (sharded or offloaded) are where their placement put them."""
    enc = encoders.get(name)
    if enc is not None and not enc.__dict__.get(_PLACED):
        p = next(iter(enc.parameters()), None)
        if p is not None and p.device != torch.device(device):
            enc.to(device)
    return enc


def save_encoders(model: nn.Module, out_dir: str | Path) -> None:
    """Write the attached encoders into ``out_dir/<name>/`` (their own ``save_pretrained``), so
    an exported folder renders and resumes with the same frozen VAE / text encoder. Not
    collective: an encoder placed by :func:`place_encoders` is rebuilt whole from its source."""
    for name, enc in encoders_of(model).items():
        placed, build = enc.__dict__.get(_PLACED), enc.__dict__.get(_BUILD)
        if placed and build is not None:  # sharded / offloaded (maybe bf16): a fresh full copy
            enc = build()  # from its config (seeded) or folder: the same weights
        elif placed == "shard":  # attached by hand, then sharded: no source to rebuild from
            raise ValueError(
                f"{name}: a sharded encoder attached with attach_encoder cannot be exported "
                "(attach it through the model config, or save it before place_encoders)"
            )
        enc.save_pretrained(str(Path(out_dir) / name))


def get_encoder(model: nn.Module, name: str, device: torch.device) -> nn.Module | None:
    """The frozen encoder ``name`` of ``model`` on ``device`` (moved there once), or None."""
    return on_device(encoders_of(model), name, device)
