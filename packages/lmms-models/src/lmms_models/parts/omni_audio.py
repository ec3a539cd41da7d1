"""The Omni audio part, after the Qwen2.5-Omni thinker (``Qwen2_5OmniThinkerForConditionalGeneration``): the text-generating
part of Qwen2.5-Omni (the talker and the speech decoder are not trained). A Qwen2.5-VL-style
windowed ViT, a Whisper-style audio encoder that already attends within 2 s chunks (``n_window``,
varlen by construction: no 30 s padding) and projects to the text width, and a Qwen2.5 decoder
with TMRoPE: 3-D positions where video time advances 25 positions per second and, with
``use_audio_in_video``, a video's frames and its sound track are interleaved in 2 s chunks.

The packed forward feeds upstream modules: positions ``[4, 1, T]`` computed per sample (lmms-data
at run time, upstream's ``get_rope_index`` in tests), vision through the Qwen-VL host merge, the
audio tower on the pack's clips (valid frames only, concatenated), all features placed at host-known
placeholder positions.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _flops
from .._audio import merge_audio, whisper_lengths
from .._spec import to_device
from .._vl import QwenVLSpec
from .omni_checkpoint import is_full_omni, load_thinker, write_full_omni

__all__ = ["OmniAudioPart", "omni_audio_flops"]

_AUDIO_KEYS = ("input_features", "audio_feature_lens", "audio_frames")


def omni_audio_flops(audio_config: Any, feature_lens: Any) -> float:
    """Training FLOPs of the Qwen2.5-Omni audio encoder on clips of ``feature_lens`` valid frames:
    ``6·N`` per frame (first convolution), per position (second convolution, blocks) and per
    token (``ln_post``, ``proj``), plus attention within each chunk of ``2·n_window`` frames."""
    g = lambda k: _flops._get(audio_config, k)  # noqa: E731
    d, ffn, layers = g("d_model"), g("encoder_ffn_dim"), g("encoder_layers")
    lens = torch.as_tensor(feature_lens).reshape(-1).long()
    after_conv, out_len = whisper_lengths(lens)
    chunk = 2 * g("n_window")
    sq = 0.0
    for n in lens.tolist():  # chunks of `chunk` frames, the last partial
        full, rest = divmod(n, chunk)
        sizes = [chunk] * full + ([rest] if rest else [])
        sq += sum(float((s - 1) // 2 + 1) ** 2 for s in sizes)
    block = 4 * d * d + 3 * d + 2 * d * ffn + ffn + d + 4 * d
    per_out = 2 * d + d * g("output_dim") + g("output_dim")
    dense = (3 * g("num_mel_bins") * d + d) * float(lens.sum())
    dense += (3 * d * d + d + layers * block) * float(after_conv.sum()) + per_out * float(
        out_len.sum()
    )
    return 6.0 * dense + 12.0 * layers * d * sq


#: models whose towers must run on every rank (:meth:`OmniAudioPart.install_participation`)
_EVERY_TOWER: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _Participation:
    """The handle of :meth:`OmniAudioPart.install_participation` (``.remove()``)."""

    def __init__(self, model: nn.Module, inner: Any) -> None:
        self.model, self.inner = model, inner

    def remove(self) -> None:
        _EVERY_TOWER.discard(self.model)
        if self.inner is not None:
            self.inner.remove()


class OmniAudioPart(QwenVLSpec):
    """The Omni thinker's audio side, composed with a vision part (``Qwen2_5VisionPart`` or
    ``Qwen3VisionPart``): the audio tower and its host-precomputed inputs, TMRoPE positions
    (upstream's ``get_rope_index``), both towers in a fixed order under several ranks, the
    thinker layouts of transformers' versions and the full-Omni checkpoint layout."""

    #: TMRoPE times kept fractional (float32 position rows) instead of integers
    fractional_positions = False
    media_keys = (*QwenVLSpec.media_keys, *_AUDIO_KEYS)
    #: audio entries that stay on the host (a family adds them to its vision part's ``host_keys``)
    audio_host_keys = ("audio_feature_lens", "audio_frames")
    #: How a video and its own sound track interleave (``use_audio_in_video``): in runs of
    #: ``seconds_per_chunk`` of TMRoPE time ("chunks"), or token by token ("tokens", Qwen3-Omni).
    audio_in_video = "chunks"
    #: the unpacked thinker's keyword arguments for padded windows and their frame mask (tests)
    reference_audio_keys = ("input_features", "feature_attention_mask")

    def build(self, **kwargs: Any) -> nn.Module:
        """Upstream's build. ``pretrained`` may be a released full Omni folder (thinker, talker,
        speech decoder): the thinker is read out of it (:func:`load_thinker`; on the meta device
        its config only). On the meta device the audio tower's sinusoid table (a non-persistent
        buffer no checkpoint holds) is recomputed for real, so lmms_parallel's ``materialize``
        restores it instead of refusing an uninitialisable buffer."""
        pretrained, device = kwargs.get("pretrained"), torch.device(kwargs.get("device", "cpu"))
        if pretrained is not None and device.type != "meta":
            import transformers

            model_cls = getattr(transformers, self.model_class)
            dtype = kwargs.get("dtype", torch.float32)
            model = load_thinker(model_cls, pretrained, dtype=dtype).to(device)
            self.set_attention(
                model,
                backend=kwargs.get("attn_backend", "auto"),
                vision_backend=kwargs.get("vision_attn_backend"),
            )
        else:
            model = super().build(**kwargs)
        pe = self.audio_tower(model).positional_embedding
        if pe.positional_embedding.is_meta:
            with torch.device("cpu"):
                table = pe.compute_default_singular_positional_embedding()
            pe.positional_embedding = table  # a registered buffer: assignment keeps it one
        return model

    def pretrained_weights(self, folder: str) -> dict[str, torch.Tensor]:
        """The thinker's weights of ``folder`` (full Omni or thinker only) keyed by the model's
        parameter names, in the checkpoint's dtype: what rank 0 broadcasts into the FSDP2
        shards. Read through transformers' ``from_pretrained`` (its renames and expert fusions
        of the installed version), not the raw safetensors names."""
        import transformers

        model_cls = getattr(transformers, self.model_class)
        return load_thinker(model_cls, folder, dtype="auto").state_dict()

    @staticmethod
    def thinker_holds_parts(model: nn.Module) -> bool:
        """The thinker's layout of older transformers (5.17): towers, text model (``model``),
        ``get_rope_index`` and the feature getters on the thinker itself, no base model between
        (5.24 has ``model.model`` with ``audio_tower``, ``visual``, ``language_model``)."""
        return not hasattr(model.model, "audio_tower")

    def base_model(self, model: nn.Module) -> nn.Module:
        """What holds the towers and upstream's helpers: ``model.model`` (or the thinker)."""
        return model if self.thinker_holds_parts(model) else model.model

    def text_model(self, model: nn.Module) -> nn.Module:
        base = self.base_model(model)
        return model.model if base is model else base.language_model

    def forward_module(self, model: nn.Module) -> nn.Module:
        """The base model; in the older layout the text model (the thinker's forward computes
        the logits), fed the merged ``inputs_embeds`` (:meth:`merge_media` always merges
        there)."""
        return self.text_model(model) if self.thinker_holds_parts(model) else model.model

    def finish_export(self, out: str | Path, source: str | None) -> None:
        """After the HF export of a run that started from a released full Omni folder: write
        the release's layout back (the trained thinker, the source's talker and speech decoder,
        :func:`write_full_omni`); a run from a config or a thinker folder keeps the thinker
        alone."""
        if source is None or not is_full_omni(source):
            return
        n = write_full_omni(out, source)
        print(
            f"[lmms-models] {out}: the full Omni layout of {source} (trained thinker, {n} talker "
            "/ speech-decoder tensors copied unchanged)",
            file=sys.stderr,
            flush=True,
        )

    def audio_tower(self, model: nn.Module) -> nn.Module:
        return self.base_model(model).audio_tower

    def towers(self, model: nn.Module) -> dict[str, nn.Module | None]:
        return {**super().towers(model), "audio": self.audio_tower(model)}

    def vision_blocks(self, model: nn.Module) -> list[nn.Module]:
        """Both towers' blocks (FSDP2 units, activation checkpointing, compile)."""
        return [*super().vision_blocks(model), *self.audio_tower(model).layers]

    def set_attention(self, model: nn.Module, **kwargs: Any) -> dict[str, str]:
        """The audio tower gets the vision tower's attention (never the text one: that may be
        the Ulysses SP wrapper, and the audio chunks are not the pack's segments)."""
        names = super().set_attention(model, **kwargs)
        self.audio_tower(model).config._attn_implementation = names["vision"]
        return names

    def sample_position_ids(
        self, model: nn.Module, input_ids: torch.Tensor, **media: Any
    ) -> torch.Tensor:
        """``[4, L]`` through upstream's ``get_rope_index`` (TMRoPE). ``media``: the grids,
        ``audio_feature_lens``, ``second_per_grid_ts`` and ``use_audio_in_video``. Integer rows,
        or float32 as computed where ``fractional_positions`` (nothing rounded)."""
        ids = input_ids.reshape(1, -1)  # [1, L]
        rows, _ = self.base_model(model).get_rope_index(
            ids, media.get("image_grid_thw"), media.get("video_grid_thw"),
            torch.ones_like(ids), bool(media.get("use_audio_in_video", False)),
            media.get("audio_feature_lens"), media.get("second_per_grid_ts"),
        )  # fmt: skip
        dtype = torch.float32 if self.fractional_positions else torch.long
        text = torch.arange(ids.shape[1], device=ids.device, dtype=dtype)[None]
        return torch.cat([text, rows[:, 0].to(dtype)], 0)  # [4, L]

    def merge_media(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Vision through the Qwen-VL host merge, then the audio tower's features at the audio
        placeholders. Once :meth:`install_participation` has run for ``model`` (the caller's: its
        towers are sharded over several ranks), a tower whose media the pack lacks runs on its
        dummy input (times zero), always in the order vision, audio: with two towers the
        single-tower participation hook cannot keep every rank's FSDP collectives in the same
        order, this does."""
        audio = {k: inputs.get(k) for k in _AUDIO_KEYS}
        rest = {k: v for k, v in inputs.items() if k not in _AUDIO_KEYS}
        types = rest.get("mm_token_type_ids")
        if types is not None:
            rest["mm_token_type_ids"] = types = types.reshape(-1).cpu()  # host positions
        distributed = model in _EVERY_TOWER
        out = super().merge_media(model, rest)  # images, videos (if any) -> inputs_embeds
        vision_ran = "inputs_embeds" in out
        if audio["input_features"] is None and not distributed:
            if self.thinker_holds_parts(model):  # the text model is called: no media keys
                return {k: v for k, v in out.items() if k != "mm_token_type_ids"}
            return out
        base = self.base_model(model)
        embeds = (
            out["inputs_embeds"] if vision_ran else base.get_input_embeddings()(out["input_ids"])
        )
        zero = embeds.new_zeros((), dtype=torch.float32)  # [1, T, H] embeds above
        if distributed and not vision_ran:
            dummy = self.vision_tower(model)(**self.dummy_vision_inputs(model, embeds.device))
            outs = (dummy.pooler_output, *(getattr(dummy, "deepstack_features", None) or ()))
            zero = zero + sum(t.float().sum() for t in outs) * 0.0  # deepstack mergers too
        tower, dev = self.audio_tower(model), embeds.device
        if audio["input_features"] is not None:
            if types is None:
                raise ValueError("audio in a pack needs mm_token_type_ids (3 on audio tokens)")
            lens = audio["audio_feature_lens"].reshape(-1).long().cpu()
            features = to_device(audio["input_features"], dev).transpose(0, 1)  # [M, F]
            feats = self.run_audio_tower(tower, features, lens)  # [N, H]
            embeds = merge_audio(embeds, types, feats)
        elif distributed:
            zero = zero + self.dummy_audio(tower, dev).float().sum() * 0.0
        dropped = ("input_ids", "mm_token_type_ids", "pixel_values", "pixel_values_videos",
                   "image_grid_thw", "video_grid_thw", "second_per_grid_ts", "inputs_embeds")  # fmt: skip
        kept = {k: v for k, v in out.items() if k not in dropped}
        return {**kept, "inputs_embeds": embeds + zero.to(embeds.dtype)}

    def install_participation(self, model: nn.Module, device: Any) -> Any:
        """Both towers run on every rank in every step, vision then audio (:meth:`merge_media`),
        besides the vision hook of the default (which then finds the tower already run)."""
        inner = super().install_participation(model, device)
        _EVERY_TOWER.add(model)
        return _Participation(model, inner)

    def audio_token_lengths(self, frames: torch.Tensor, audio_config: Any = None) -> torch.Tensor:
        """Text placeholders per clip of ``frames [n]`` valid mel frames (any config)."""
        return whisper_lengths(frames)[1]

    def run_audio_tower(
        self, tower: nn.Module, features: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """The tower on the pack's clips: ``features [M, F]`` (mel bins, concatenated valid
        frames) on the device, host ``lens [n]`` -> ``[N, H]`` features in clip order."""
        dev = features.device
        return tower(
            input_features=features,
            feature_lens=to_device(lens, dev),
            aftercnn_lens=to_device(whisper_lengths(lens)[0], dev),
            **self.host_audio_inputs(tower, features, lens),
        ).last_hidden_state

    def dummy_audio(self, tower: nn.Module, device: torch.device) -> torch.Tensor:
        """The tower on its smallest clip (4 frames, one token): every parameter in the graph
        for a rank whose pack has no audio."""
        return tower(
            input_features=torch.zeros(tower.conv1.weight.shape[1], 4, device=device),
            feature_lens=torch.tensor([4], device=device),
            aftercnn_lens=torch.tensor([2], device=device),
        ).last_hidden_state

    def host_audio_inputs(
        self, tower: nn.Module, features: torch.Tensor, lens: torch.Tensor
    ) -> dict[str, Any]:
        """What the audio tower derives from ``feature_lens`` (2 s chunks, their ``cu_seqlens``
        and maximum, the valid and pooling indices), computed on the host by transformers' own
        helpers from the host ``lens [n]`` and handed over ready, where the installed
        transformers takes them (5.24 does; from device lengths the tower reads them back with
        several host synchronisations). ``features [M, F]`` on the device: only split by host
        chunk lengths. Empty when the helpers are missing (the tower computes them itself)."""
        import importlib

        module = importlib.import_module(type(tower).__module__)
        helpers = ("chunk_and_pad_features", "get_audio_cu_seqlens", "get_valid_indices",
                   "get_pool_indices")  # fmt: skip
        if not all(hasattr(module, h) for h in helpers):
            return {}
        padded, chunks = module.chunk_and_pad_features(
            features, lens, tower.n_window
        )  # host chunks
        cu = module.get_audio_cu_seqlens(chunks)
        dev = features.device
        return {
            "padded_feature": padded,
            "chunk_lengths": to_device(chunks, dev),
            "cu_seqlens": to_device(cu, dev),
            "max_seqlen": int((cu[1:] - cu[:-1]).max()),
            "valid_indices": to_device(module.get_valid_indices(chunks), dev),
            "pool_indices": to_device(module.get_pool_indices(lens), dev),
        }

    def media_flops(self, config: Any, batch: dict[str, Any]) -> float:
        total = super().media_flops(config, batch)
        lens = batch.get("audio_feature_lens")
        if lens is not None and len(lens):
            total += omni_audio_flops(config.audio_config, lens)
        return total
