"""``bagel``: BAGEL, unified image understanding and generation (Mixture-of-Transformers).

A Qwen2.5 decoder whose every layer has a second set of weights for generation (VAE latent)
tokens, a SigLIP NaViT encoder for understanding images at native resolution, and VAE latent
tokens trained by flow matching; text by cross-entropy. The model is :class:`Bagel` (written here
with the public checkpoint's parameter names, see ``_model.py``); packed rows come from
:func:`pack_samples` (``_pack.py``: per-span attention rules in ``_mask.py``); the objective is
``ce_flow_matching`` (lmms_models.objectives). Preset ``7b-mot``: BAGEL-7B-MoT (14B total, 7B
active). Docs: docs/bagel.md.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._capabilities import MixedGeneration, RenderRequest, Renders
from ..._data_plan import ModelPackedRows
from ..._registry import register_model
from ..._spec import ModelSpec
from ._mask import CAUSAL, FULL, NOISE, PackLayout, dense_mask, span_attention
from ._model import Bagel, BagelConfig, LLMConfig, MoTDecoderLayer, SiglipEncoderLayer, ViTConfig
from ._pack import batch_to, pack_samples, patchify, pixel_space_latents, unpatchify
from ._vae import FLUX_VAE_CONFIG, diffusers_to_flux, flux_to_diffusers, load_flux_vae

__all__ = [
    "CAUSAL",
    "FLUX_VAE_CONFIG",
    "FULL",
    "NOISE",
    "Bagel",
    "BagelConfig",
    "BagelSpec",
    "LLMConfig",
    "MoTDecoderLayer",
    "PackLayout",
    "SiglipEncoderLayer",
    "ViTConfig",
    "batch_to",
    "dense_mask",
    "diffusers_to_flux",
    "flux_to_diffusers",
    "load_flux_vae",
    "pack_samples",
    "patchify",
    "pixel_space_latents",
    "span_attention",
    "unpatchify",
]

PRESETS: dict[str, dict[str, Any]] = {
    # BAGEL-7B-MoT: Qwen2.5-7B (+ QK-norm) x 2 experts, SigLIP so400m/14 minus its last layer,
    # FLUX VAE latents (16 channels, /8) in 2 x 2 patches, 64 x 64 latent position table.
    "7b-mot": {
        "llm": {},
        "vit": {},
        "latent_channels": 16,
        "vae_downsample": 8,
        "latent_patch_size": 2,
        "max_latent_size": 64,
        "vit_max_num_patch_per_side": 70,
    }
}


@register_model("bagel")
class BagelSpec(ModelSpec, MixedGeneration, Renders):
    """The engine's view of BAGEL. Not a transformers class: :meth:`build` makes a :class:`Bagel`."""

    processor_family = "bagel"
    synthetic_kind = "bagel"  # lmms-train's generate_synthetic default (lmms_data)
    presets = PRESETS
    default_objective = "ce_flow_matching"
    objective_defaults: dict[str, Any] = {}  # noqa: RUF012 (ce_flow_matching's own defaults)
    # no liger_plan: its RMSNorm/SwiGLU are its own modules (none yet)
    media_keys = ("vit_patches", "vae_latents")
    #: Ulysses SP over the decoder stack with the span masks kept whole (lmms_parallel's row
    #: styles, applied by ``ModelSpec.install_sp``): every rank embeds the whole row, the stack
    #: runs on this rank's slice of tokens and attends over all of them for its share of the
    #: heads (``check_sp``: query and KV heads divisible), its output is gathered.
    sp_plan = {  # noqa: RUF012
        "language_model.model": "sp_row_stack",
        "language_model.model.layers.*.self_attn": "sp_row_attention",
    }

    def objective_capabilities(self) -> frozenset[str]:
        """Text cross-entropy and flow matching on generation latents in one forward."""
        return frozenset({"token_lm", "ce_flow_heads"})

    def config_keys(self) -> dict[str, Any]:
        """:class:`BagelConfig`'s keys and ``vae`` (a VAE config dict or a local file)."""
        return {**super().config_keys(), "vae": None}

    def check_sp(self, config: Any, sp: int) -> None:
        """Ulysses SP (``_sp.py``) splits the query and the key/value heads over ``sp``."""
        if config is None:
            return
        heads, kv = config.llm.num_attention_heads, config.llm.num_key_value_heads
        if heads % sp or kv % sp:
            raise ValueError(
                f"sp_ulysses_degree {sp} must divide bagel's {heads} attention heads and "
                f"{kv} key/value heads"
            )

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "llm": dict(
                vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, qk_norm=True,
            ),
            "vit": dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                patch_size=4, image_size=64,
            ),
            "latent_channels": 4, "vae_downsample": 8, "latent_patch_size": 2,
            "max_latent_size": 16, "vit_max_num_patch_per_side": 16,
        }  # fmt: skip
        for k, v in overrides.items():
            conf[k] = {**conf[k], **v} if isinstance(v, dict) and k in ("llm", "vit") else v
        return conf

    def make_config(self, config: dict[str, Any] | BagelConfig) -> BagelConfig:
        """A :class:`BagelConfig` from this family's dict (``vae`` and the trainer's top-level
        ``*_token_id`` keys of a local tokenizer are not model hyper-parameters: dropped)."""
        if isinstance(config, BagelConfig):
            return config
        drop = lambda k: k == "vae" or k.endswith("_token_id")  # noqa: E731
        return BagelConfig.from_dict({k: v for k, v in config.items() if not drop(k)})

    def pretrained_config(self, path: str) -> dict[str, Any]:
        """The config dict of a local folder: ``config.json`` (this family's keys, what lmms
        exports), or the public release's ``llm_config.json`` + ``vit_config.json`` (Qwen2 and
        SigLIP configs, read as the authors' loader does: QK-norm on, untied head, the ViT's
        last layer dropped; 2 x 2 latent patches, 64 x 64 latent and 70 x 70 ViT position
        tables) with its FLUX ``ae.safetensors`` as the VAE."""
        folder = Path(path)
        if (folder / "config.json").is_file() or not (folder / "llm_config.json").is_file():
            return json.loads((folder / "config.json").read_text())
        llm = json.loads((folder / "llm_config.json").read_text())
        vit = json.loads((folder / "vit_config.json").read_text())
        keep = lambda d, cls: {k: d[k] for k in cls.__dataclass_fields__ if k in d}  # noqa: E731
        conf: dict[str, Any] = dict(self.presets["7b-mot"])
        conf["llm"] = {**keep(llm, LLMConfig), "qk_norm": True, "tie_word_embeddings": False}
        conf["vit"] = {**keep(vit, ViTConfig), "num_hidden_layers": vit["num_hidden_layers"] - 1}
        if (folder / "ae.safetensors").is_file():
            conf["vae"] = str(folder / "ae.safetensors")
        return conf

    def weights_file(self, path: str) -> Path:
        """The trained weights of a local folder: ``model.safetensors`` (an lmms export) or
        ``ema.safetensors`` (the public release; its ``ae.safetensors`` is the VAE's)."""
        folder = Path(path)
        for name in ("model.safetensors", "ema.safetensors"):
            if (folder / name).is_file():
                return folder / name
        raise FileNotFoundError(f"{folder}: no model.safetensors or ema.safetensors")

    def attach_vae(self, model: nn.Module, source: dict[str, Any] | str) -> None:
        """Attach the frozen VAE outside the trained module tree (not in the state dict, FSDP
        units or checkpoints): ``"pixel_space"`` (no network: average pooling by
        ``vae_downsample``, the tiny examples' stand-in, ``latent_channels: 3``), a config dict
        (a diffusers ``AutoencoderKL`` with seeded random weights) or a local folder (diffusers
        layout, or a FLUX-layout ``ae.safetensors``: :func:`load_flux_vae`)."""
        from ..._diffusion import attach_encoder, require_diffusers

        if source == "pixel_space":
            if model.config.latent_channels != 3:
                raise ValueError("bagel: vae: pixel_space needs latent_channels: 3 (RGB latents)")
            model.pixel_space_vae = True
            return
        diffusers = require_diffusers()
        if isinstance(source, str):
            from ._vae import load_vae_folder

            vae = load_vae_folder(source)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                vae = diffusers.AutoencoderKL(**source)
        attach_encoder(model, "vae", vae)

    def pixel_encoder(self, model: nn.Module) -> Any:
        """``pixels [3, H, W] in [-1, 1] -> latents [C, H/f, W/f]`` through the attached VAE
        (posterior mean, ``(z - shift_factor) * scaling_factor`` as the FLUX VAE is used), the
        pixel-space stand-in, or None without either (``pack_samples(encode=...)``)."""
        from ..._diffusion import encoders_of
        from ...parts.latent import encode_latents

        if getattr(model, "pixel_space_vae", False):
            return pixel_space_latents(_cfg(model).vae_downsample)
        vae = encoders_of(model).get("vae")
        if vae is None:
            return None
        return lambda px: encode_latents(vae.to(px.device), px[None])[0]

    def latent_decoder(self, model: nn.Module) -> Any:
        """``latents [C, h, w] -> pixels [3, H, W]``: the inverse scaling, then the VAE decoder
        (pixel space: nearest upsampling)."""
        from ..._diffusion import encoders_of

        if getattr(model, "pixel_space_vae", False):
            f = _cfg(model).vae_downsample
            return lambda z: torch.nn.functional.interpolate(z[None].float(), scale_factor=f)[0]
        vae = encoders_of(model).get("vae")
        if vae is None:
            return None
        shift = getattr(vae.config, "shift_factor", None) or 0.0

        @torch.no_grad()
        def dec(z: torch.Tensor) -> torch.Tensor:
            z = z[None] / vae.config.scaling_factor + shift
            return vae.to(z.device).decode(z.to(next(vae.parameters()).dtype)).sample[0].float()

        return dec

    def build_module(
        self, source: dict[str, Any] | str, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """A :class:`Bagel` from a config dict, or a local folder (:meth:`pretrained_config`:
        an lmms export or the public release) with ``model.safetensors`` / ``ema.safetensors``
        (the public layout)."""
        folder = source if isinstance(source, str) else None
        config = self.pretrained_config(source) if isinstance(source, str) else source
        with torch.device(device):
            model = Bagel(self.make_config(config))
        if folder is not None and device.type != "meta":
            from safetensors.torch import load_file

            model.load_state_dict(load_file(str(self.weights_file(folder))))
        model = model.to(dtype)
        vae = config.get("vae")
        if folder is not None and vae is None and (Path(folder) / "vae" / "config.json").is_file():
            vae = str(Path(folder) / "vae")
        if vae is not None:
            self.attach_vae(model, vae)
        return model

    # ---------------------------------------------------------------- data (lmms-train)
    def data_plan(self, model_config: Callable[[], dict[str, Any]]) -> ModelPackedRows:
        """Rows of parts (the ``bagel`` processor, :meth:`processor_options` of the model's
        config) that :meth:`finish_pack` packs on the host."""
        config = model_config()
        return ModelPackedRows(
            processor_options=self.processor_options(config),
            finish=functools.partial(self.finish_pack, config),
        )

    def processor_options(self, config: dict[str, Any] | BagelConfig) -> dict[str, Any]:
        """lmms_data ``bagel`` processor options that must match the model (patch sizes and the
        largest sides its position tables hold); ``dataset_config.extra`` may lower the sides."""
        cfg = self.make_config(config)
        lat_down = cfg.vae_downsample * cfg.latent_patch_size
        return {
            "vit_patch_size": cfg.vit.patch_size,
            "max_vit_side": cfg.vit.patch_size * cfg.vit_max_num_patch_per_side,
            "latent_downsample": lat_down,
            "max_gen_side": lat_down * cfg.max_latent_size,
        }

    def finish_pack(
        self, config: dict[str, Any] | BagelConfig, row: dict[str, Any], backend: str = "auto",
        pad_to: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """lmms_data's row of parts (``collate_parts``) -> the packed row (:func:`pack_samples`,
        host tensors; VAE pixels are encoded later on the device by :meth:`prepare_row`).

        ``pad_to``: append a padding sample (unsupervised text, its own sample: it attends and is
        attended only within itself) so every row has this length; the compiled FlexAttention
        (static shapes) then compiles once. ``num_samples`` counts the real samples only."""
        cfg = self.make_config(config)
        parts, seeds = list(row["bagel_parts"]), list(row["seeds"])
        n_pad = 0 if pad_to is None else pad_to - sum(row["lengths"])
        if n_pad > 0:
            parts.append([{"type": "text", "ids": [0] * n_pad, "loss": False}])
            seeds.append(0)
        out = pack_samples(
            parts, cfg, start_of_image=row["start_of_image"], end_of_image=row["end_of_image"],
            seeds=seeds, backend=backend,
        )  # fmt: skip
        out["num_samples"] = len(row["lengths"])
        if out["layout"].sample_lens[: len(row["lengths"])] != list(row["lengths"]):
            raise ValueError(
                f"bagel: packed sample lengths {out['layout'].sample_lens} differ from the "
                f"processor's {list(row['lengths'])}: dataset_config.extra's vit_patch_size / "
                "latent_downsample must match the model (leave them unset)"
            )
        out["vision_tokens"] = int(row.get("vision_tokens", 0))
        return out

    def prepare_row(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        """The row on the device of its ``input_ids`` (the layout and latent lists too), with
        ``vae_pixels`` encoded to ``vae_latents`` by the frozen VAE (no gradient)."""
        batch = batch_to(batch, batch["input_ids"].device)
        pixels = batch.pop("vae_pixels", None)
        if pixels is None:
            return batch
        enc = self.pixel_encoder(model)
        if enc is None:
            raise ValueError(
                "bagel: the row has images to encode but the model has no VAE (model config "
                "`vae`: a diffusers AutoencoderKL config or folder, or pixel_space)"
            )
        with torch.no_grad():
            batch["vae_latents"] = [
                lat if px is None else enc(px).float()
                for lat, px in zip(batch["vae_latents"], pixels, strict=True)
            ]
        return batch

    def export_writer(self, model: nn.Module) -> Any:
        """Exports write this family's folder (config.json + model.safetensors + vae/)."""
        return functools.partial(save_bagel, model)

    def render(self, model: nn.Module, request: RenderRequest) -> Any:
        """One image per prompt, side by side (:func:`._render.render_images`)."""
        from ._render import render_images

        return render_images(self, model, request)

    def set_attention(
        self,
        model: nn.Module,
        *,
        backend: str = "auto",
        vision_backend: str | None = None,
        **_: Any,
    ) -> dict[str, str]:
        """The ViT's varlen backend; the decoder's span attention is chosen per row
        (``PackLayout.backend``)."""
        model.vit_model.attn_backend = vision_backend or backend
        return {}

    # ---------------------------------------------------------------- objective hooks
    def latent_tokens(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``[C, H, W]`` latents -> ``[n, p*p*C]`` tokens."""
        return patchify(x, _cfg(model).latent_patch_size)

    def latent_image(
        self, model: nn.Module, tokens: torch.Tensor, like: torch.Tensor
    ) -> torch.Tensor:
        p = _cfg(model).latent_patch_size
        return unpatchify(tokens, like.shape[0], like.shape[1] // p, like.shape[2] // p, p)

    def mixed_forward(
        self, model: nn.Module, batch: dict[str, Any], tokens: torch.Tensor | None,
        time: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``(hidden at the supervised text rows [N_ce, hidden], their labels [N_ce], velocity
        predictions [N_noised, p*p*C])`` of one row (the whole row under SP: install_sp)."""
        from ..._diffusion import call_denoiser

        hidden, pred = call_denoiser(model, batch, tokens, time)
        ce_idx = batch["ce_index"]
        return hidden[ce_idx], batch["labels"][ce_idx], pred

    def packed_forward(
        self, model: nn.Module, batch: dict[str, Any], *, sp_group: Any = None,
        loss_backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(text cross-entropy sum, supervised text tokens)`` of one row with every latent
        image clean (noise level 0): the understanding loss alone (``causal_lm``). Under SP every
        rank holds the whole row's sum: its gradient share is ``1 / sp``."""
        from lmms_kernels import fused_linear_cross_entropy

        batch = self.prepare_row(model, batch)
        latents = batch["vae_latents"]
        tokens = torch.cat([self.latent_tokens(model, x) for x in latents]) if latents else None
        time = None if tokens is None else tokens.new_zeros(tokens.shape[0])
        hidden, labels, _ = self.mixed_forward(model, batch, tokens, time)
        head = self.lm_head(model)
        loss_sum, n = fused_linear_cross_entropy(
            hidden, head.weight, labels, bias=head.bias, backend=loss_backend
        )
        if sp_group is not None:
            from lmms_parallel import sp_replicated_grad

            loss_sum = sp_replicated_grad(loss_sum, sp_group)
        return loss_sum, n

    # ---------------------------------------------------------------- engine hooks
    def base_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def text_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.language_model.model.layers)

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        return model.vit_model

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.vit_model.vision_model.encoder.layers)

    def block_classes(self, model: nn.Module) -> list[type[nn.Module]]:
        return [MoTDecoderLayer, SiglipEncoderLayer]

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        return [model.language_model.model.embed_tokens]

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.language_model.lm_head

    def muon_adamw_modules(self, model: nn.Module) -> list[nn.Module]:
        """Matrices lmms-train's Muon leaves to AdamW besides the embedding table and the LM
        head: the other modalities' input and output projections (ViT patch embedding,
        connector, ``vae2llm``, the time MLP, the velocity head ``llm2vae``)."""
        return [model.vit_model.vision_model.embeddings, model.connector, model.vae2llm,
                model.time_embedder, model.llm2vae]  # fmt: skip

    def check_tp(self, config: Any, tp: int) -> None:
        if tp > 1:
            raise NotImplementedError("bagel: no tensor-parallel plan yet; use FSDP2")

    # ---------------------------------------------------------------- FLOPs
    def mot_flops(self, config: dict[str, Any] | BagelConfig, batch: dict[str, Any]) -> float:
        """Training FLOPs of a packed row: the sum of :meth:`pack_flops`."""
        return sum(self.pack_flops(config, batch))

    def pack_flops(
        self, config: dict[str, Any] | BagelConfig, batch: dict[str, Any],
        lens: Sequence[int] | None = None,
    ) -> tuple[float, float]:  # fmt: skip
        """``(decoder, media)`` training FLOPs (6 x matmul parameters per token, + attention as
        executed) of a packed row (``lens`` unused: the row's layout has the samples);
        lmms-train's MFU reads them (``mfu_lm`` is the first).
        Decoder: each token runs exactly one expert's weights (MoT: understanding tokens the
        first set, latent tokens the second), so the count is one dense Qwen2.5 per token;
        attention counts the mask's allowed pairs (dense per sample, causal half for text), plus
        the LM head on supervised text only. Media: the ViT over its own images, the connector,
        the latent projections (``llm2vae`` on the noised tokens only) and the time MLP.
        Recomputation (activation checkpointing) is not counted, as for every family."""
        cfg = self.make_config(config)
        llm, vit = cfg.llm, cfg.vit
        h, kv = llm.hidden_size, llm.num_key_value_heads * llm.head_dim
        per_tok = llm.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * llm.intermediate_size)
        t = int(batch["input_ids"].numel())
        flops = 6.0 * per_tok * t + 6.0 * h * llm.vocab_size * int(batch["num_ce_tokens"])
        layout: PackLayout = batch["layout"]
        pairs = sum(int(m.sum()) for m in layout.sample_masks())
        flops += 12.0 * llm.num_hidden_layers * h * pairs  # QK^T and PV, fwd + bwd
        lm, flops = flops, 0.0
        vh = vit.hidden_size
        n_vit = int(batch["vit_patches"].shape[0])
        vit_tok = vit.num_hidden_layers * (4 * vh * vh + 2 * vh * vit.intermediate_size)
        vit_tok += vit.num_channels * vit.patch_size**2 * vh + vh * h + h * h  # embed, connector
        lens = (batch["vit_cu"][1:] - batch["vit_cu"][:-1]).tolist()
        flops += 6.0 * vit_tok * n_vit + 12.0 * vit.num_hidden_layers * vh * sum(
            n * n for n in lens
        )
        n_vae, n_fm = int(batch["vae_pos"].numel()), int(batch["num_fm_tokens"])
        flops += 6.0 * (cfg.patch_latent_dim * h + 256 * h + h * h) * n_vae  # vae2llm, time MLP
        flops += 6.0 * h * cfg.patch_latent_dim * n_fm  # llm2vae on the noised tokens only
        return lm, flops

    def tokens_per_sample(self, config: Any, lens: Sequence[int]) -> int:
        return int(sum(lens))


def _cfg(model: nn.Module) -> BagelConfig:
    return model.config


def save_bagel(
    model: nn.Module, out_dir: str, *, state_dict: dict[str, torch.Tensor] | None = None,
    **_: Any,
) -> None:  # fmt: skip
    """Write ``out_dir`` as :meth:`BagelSpec.build` reads it: ``config.json`` (this family's
    dict; ``vae: pixel_space`` for the stand-in), ``model.safetensors`` (the public layout) and
    the frozen VAE in ``vae/`` (diffusers layout)."""
    from safetensors.torch import save_file

    from ..._diffusion import encoders_of, save_encoders

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conf = _cfg(model).to_dict()
    if getattr(model, "pixel_space_vae", False):
        conf["vae"] = "pixel_space"
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    state = model.state_dict() if state_dict is None else state_dict
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
              str(out / "model.safetensors"))  # fmt: skip
    if encoders_of(model):
        save_encoders(model, out)
