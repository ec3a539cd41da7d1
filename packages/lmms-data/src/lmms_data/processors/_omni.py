"""Qwen2.5-Omni (thinker) processor: chat records with text, images, videos (optionally with their
own sound track) and audio -> samples with TMRoPE positions.

Images and video frames are patchified as for Qwen2.5-VL (:class:`QwenVLProcessor`); audio parts
and, with ``use_audio_in_video``, each video's sound track are decoded (soundfile / PyAV, mono,
soxr to the extractor's rate) and turned into log-mel features by the folder's own feature
extractor, keeping the valid frames only (the Omni audio encoder reads nothing else). Placeholders
are expanded as upstream's processor does: ``<audio>`` to ``((n-1)//2+1-2)//2+1`` tokens for ``n``
valid frames; a video with its sound becomes ``<audio_bos>`` + video and audio tokens interleaved
in ``seconds_per_chunk`` chunks of TMRoPE time + ``<audio_eos>`` inside the video's vision markers.

Positions (:func:`tmrope_positions`) follow ``Qwen2_5OmniThinkerModel.get_rope_index`` (tested
equal): text, markers and audio advance one position per token; an image or video block starts
one past its marker, with (t, h, w) grid positions where video time is
``int(t · second_per_grid · position_id_per_seconds)``; the token after a block continues one past
the largest position of the last piece placed (the last chunk of an interleaved block).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmms_data._audio import load_audio_clips
from lmms_data._local_processor import register_local_processor
from lmms_data._media import load_image
from lmms_data._registry import register_processor
from lmms_data.processors._audio import (
    AUDIO_TYPE_ID,
    AudioFeatures,
    audio_options,
    audio_output_lengths,
    load_feature_extractor,
    tokens_per_group,
)
from lmms_data.processors._chat import (
    check_slots,
    fill_slots,
    template_messages,
    tokenize_media,
)
from lmms_data.processors._qwen_vl import QwenVLProcessor

__all__ = ["Qwen2_5OmniDataProcessor", "chunk_ranges", "tmrope_positions"]


def chunk_ranges(values: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of the non-decreasing ``values`` falling in successive windows of
    ``per_chunk`` (upstream's ``get_chunked_index``); at least one range."""
    out, start, chunk = [], 0, 1
    for i, v in enumerate(values.tolist()):
        if v >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(values)))
    return out


def _video_time(grid_t: int, second_per_grid: float, per_second: float) -> np.ndarray:
    """TMRoPE time index per temporal patch: float32 products truncated, as torch computes it."""
    t = np.arange(grid_t, dtype=np.float32) * np.float32(second_per_grid)
    return (t * np.float32(per_second)).astype(np.int64)  # [grid_t]


def _grid_positions(start: int, t_idx: np.ndarray, grid: np.ndarray, merge: int) -> np.ndarray:
    h, w = int(grid[1]) // merge, int(grid[2]) // merge
    tt, hh, ww = np.meshgrid(t_idx, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start  # [3, t*h*w]


def tmrope_positions(
    ids: np.ndarray,  # [L]
    *,
    tokens: dict[str, int],  # image, video, audio, vision_bos, vision_eos, audio_bos, audio_eos
    image_grid_thw: np.ndarray | None,
    video_grid_thw: np.ndarray | None,
    audio_tokens: list[int],  # tokens per audio block, in order (videos' sound tracks included)
    second_per_grid: list[float],
    merge: int,
    per_second: float = 25,
    seconds_per_chunk: float = 2,
) -> np.ndarray:  # [3, L]
    """TMRoPE positions of one sample (see the module docstring)."""
    L = len(ids)
    out = np.empty((3, L), dtype=np.int64)
    last, i = -1, 0  # `last`: the largest position of the last piece placed
    n_img = n_vid = n_aud = 0
    per_chunk = int(per_second * seconds_per_chunk)
    while i < L:
        tok = int(ids[i])
        if tok == tokens["vision_bos"] and i + 1 < L and int(ids[i + 1]) == tokens["audio_bos"]:
            out[:, i : i + 2] = last + 1  # both markers share one position
            st = last + 2
            grid = video_grid_thw[n_vid]
            t_idx = _video_time(int(grid[0]), second_per_grid[n_vid], per_second)
            vid = _grid_positions(st, t_idx, grid, merge)
            aud = np.broadcast_to(np.arange(audio_tokens[n_aud]) + st, (3, audio_tokens[n_aud]))
            v_chunks = chunk_ranges(vid[0] - st, per_chunk)
            a_chunks = chunk_ranges(aud[0] - st, per_chunk)
            j = i + 2
            for k in range(max(len(v_chunks), len(a_chunks))):
                for chunks, pos in ((v_chunks, vid), (a_chunks, aud)):
                    if k < len(chunks):
                        a, b = chunks[k]
                        out[:, j : j + b - a] = pos[:, a:b]
                        j += b - a
                        last = int(pos[:, a:b].max()) if b > a else last
            out[:, j : j + 2] = last + 1  # audio_eos, vision_eos
            last += 1
            i, n_vid, n_aud = j + 2, n_vid + 1, n_aud + 1
        elif tok in (tokens["vision_bos"], tokens["audio_bos"]):
            out[:, i] = last + 1
            st = last + 2
            kind = int(ids[i + 1]) if i + 1 < L else -1
            if tok == tokens["audio_bos"]:
                n = audio_tokens[n_aud]
                pos = np.broadcast_to(np.arange(n) + st, (3, n))
                n_aud += 1
            elif kind == tokens["image"]:
                pos = _grid_positions(st, np.zeros(1, np.int64), image_grid_thw[n_img], merge)
                n_img += 1
            elif kind == tokens["video"]:
                grid = video_grid_thw[n_vid]
                t_idx = _video_time(int(grid[0]), second_per_grid[n_vid], per_second)
                pos = _grid_positions(st, t_idx, grid, merge)
                n_vid += 1
            else:  # a lone marker: text
                last += 1
                i += 1
                continue
            n = pos.shape[1]
            out[:, i + 1 : i + 1 + n] = pos
            last = int(pos.max()) if n else st - 1
            out[:, i + 1 + n] = last + 1  # the end marker
            last += 1
            i += n + 2
        else:
            last += 1
            out[:, i] = last
            i += 1
    return out


@register_processor("qwen2_5_omni")
class Qwen2_5OmniDataProcessor(QwenVLProcessor):
    """Chat messages with text, image, video and audio parts -> one sample.

    Options: the Qwen-VL image/video ones, ``use_audio_in_video`` (default False: a video part
    also brings its own sound track, interleaved), ``position_id_per_seconds`` (25) and
    ``seconds_per_chunk`` (2), which must equal the model config's, and the audio options of
    ``qwen2_audio`` (``audio_max_seconds`` default 30, ...).
    """

    family = "qwen2_5_omni"
    media_types: tuple[str, ...] = ("image", "video", "audio")

    def __init__(self, processor: Any, **options: Any) -> None:
        self.use_audio_in_video = bool(options.pop("use_audio_in_video", False))
        self.per_second = float(options.pop("position_id_per_seconds", 25))
        self.seconds_per_chunk = float(options.pop("seconds_per_chunk", 2))
        self.audio = audio_options(options, default_max=30.0)
        super().__init__(processor, **options)
        self.features = AudioFeatures(load_feature_extractor(processor), context_frames=0)

    def _set_tokens(self) -> None:
        """Placeholder strings from the tokenizer (Qwen2.5-Omni names them ``<|IMAGE|>``, ...),
        else the Qwen-VL / Qwen-Audio strings of lmms-data's local folders."""
        tok = self.tokenizer
        name = lambda attr, default: getattr(tok, attr, None) or default  # noqa: E731
        self.image_token = name("image_token", "<|image_pad|>")
        self.video_token = name("video_token", "<|video_pad|>")
        self.audio_token = name("audio_token", "<|AUDIO|>")
        self.vision_start = name("vision_bos_token", "<|vision_start|>")
        self.vision_end = name("vision_eos_token", "<|vision_end|>")
        self.audio_bos = name("audio_bos_token", "<|audio_bos|>")
        self.audio_eos = name("audio_eos_token", "<|audio_eos|>")
        strings = {"image": self.image_token, "video": self.video_token,
                   "audio": self.audio_token, "vision_bos": self.vision_start,
                   "vision_eos": self.vision_end, "audio_bos": self.audio_bos,
                   "audio_eos": self.audio_eos}  # fmt: skip
        self.token_ids = {k: tok.convert_tokens_to_ids(v) for k, v in strings.items()}
        missing = [strings[k] for k, v in self.token_ids.items() if v in (None, tok.unk_token_id)]
        if missing:
            raise ValueError(f"tokenizer lacks {missing}: not a Qwen2.5-Omni tokenizer")
        self.image_token_id, self.video_token_id = self.token_ids["image"], self.token_ids["video"]

    def _collect(self, messages: list[dict[str, Any]]) -> tuple[list, list, list, list, list]:
        """(images, videos, per-video sound clips, per-audio-part clips) in order, and the
        messages the chat template renders."""
        images, videos, video_sound, audios = [], [], [], []
        rate = self.features.rate

        def video(part: dict[str, Any]) -> None:
            videos.append(self._decode_video(part))
            if self.use_audio_in_video:  # one clip: the interleaving places it whole
                video_sound.append(
                    load_audio_clips(part["video"], rate, self.audio, from_video=True)[0]
                )

        take = {
            "image": lambda part: images.append(load_image(part["image"])),
            "video": video,
            "audio": lambda part: audios.append(load_audio_clips(part["audio"], rate, self.audio)),
        }
        template = template_messages(messages, self.family, take, name_media=True)
        return images, videos, video_sound, audios, template

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        images, videos, video_sound, audios, template = self._collect(messages)
        text = self.tokenizer.apply_chat_template(template, tokenize=False)
        sample: dict[str, Any] = {}
        slots = {self.image_token: images, self.video_token: videos, self.audio_token: audios}
        check_slots(text, {token: len(items) for token, items in slots.items()})
        if images:
            sample.update(self.process_images(images))
            merged = sample["image_grid_thw"].prod(-1) // self.merge**2
            text = fill_slots(text, self.image_token, [self.image_token * int(n) for n in merged])
        # audio features in token order: a video's sound track sits where its video is
        clip_lists, order = [], self._audio_order(text, len(videos))
        for kind, k in order:
            clip_lists.append([video_sound[k]] if kind == "video" else audios[k])
        flat = [c for clips in clip_lists for c in clips]
        per_block: list[int] = []
        if flat:
            sample.update(self.features(flat))
            tokens = self.audio_tokens(sample["audio_feature_lens"]).tolist()
            per_block = tokens_per_group(tokens, clip_lists)
        block_of = dict(zip(order, per_block, strict=True))
        if audios:
            fills = [self.audio_token * block_of[("audio", k)] for k in range(len(audios))]
            text = fill_slots(text, self.audio_token, fills)
        spg: list[float] = []
        if videos:
            media, grids, spg = self._patch_videos(videos)
            sample.update(media, second_per_grid_ts=np.asarray(spg, dtype=np.float32))
            fills = [
                self._video_fill(g, s, block_of.get(("video", k)))
                for k, (g, s) in enumerate(zip(grids, spg, strict=True))
            ]
            text = fill_slots(text, self.video_token, fills)
        return self._finish(sample, text, [block_of[o] for o in order], spg)

    def rope_positions(self, ids: np.ndarray, sample: dict[str, Any], audio_blocks: list[int],
                       spg: list[float]) -> np.ndarray:  # fmt: skip
        """``[4, L]`` int64: the text row and the TMRoPE rows (:func:`tmrope_positions`) of
        ``ids [L]``; ``audio_blocks``: tokens per audio block, ``spg``: seconds per grid."""
        rope = tmrope_positions(
            ids, tokens=self.token_ids, image_grid_thw=sample.get("image_grid_thw"),
            video_grid_thw=sample.get("video_grid_thw"), audio_tokens=audio_blocks,
            second_per_grid=spg, merge=self.merge, per_second=self.per_second,
            seconds_per_chunk=self.seconds_per_chunk,
        )  # fmt: skip
        return np.concatenate([np.arange(len(ids), dtype=np.int64)[None], rope])

    def audio_tokens(self, frames: np.ndarray) -> np.ndarray:
        """Text placeholders per clip of ``frames [n]`` valid mel frames."""
        return np.asarray(audio_output_lengths(frames))

    def _audio_order(self, text: str, n_videos: int) -> list[tuple[str, int]]:
        """Audio blocks in token order: ``("audio", k)`` parts and, with ``use_audio_in_video``,
        ``("video", k)`` sound tracks, by where their placeholders sit in ``text``."""
        spots = []
        for kind, token, n in (
            ("audio", self.audio_token, None),
            ("video", self.video_token, n_videos),
        ):
            if kind == "video" and not self.use_audio_in_video:
                continue
            at, k = text.find(token), 0
            while at >= 0 and (n is None or k < n):
                spots.append((at, kind, k))
                at, k = text.find(token, at + len(token)), k + 1
        return [(kind, k) for _, kind, k in sorted(spots)]

    def _video_fill(self, grid: np.ndarray, spg: float, n_audio: int | None) -> str:
        n_vid = int(grid.prod()) // self.merge**2
        if n_audio is None:
            return self.video_token * n_vid
        t_idx = _video_time(int(grid[0]), spg, self.per_second)
        values = np.repeat(t_idx, n_vid // int(grid[0]))
        per_chunk = int(self.per_second * self.seconds_per_chunk)
        v_chunks = chunk_ranges(values, per_chunk)
        a_chunks = chunk_ranges(np.arange(n_audio), per_chunk)
        out = self.audio_bos
        for k in range(max(len(v_chunks), len(a_chunks))):
            if k < len(v_chunks):
                out += self.video_token * (v_chunks[k][1] - v_chunks[k][0])
            if k < len(a_chunks):
                out += self.audio_token * (a_chunks[k][1] - a_chunks[k][0])
        return out + self.audio_eos

    def _finish(
        self, sample: dict[str, Any], text: str, audio_blocks: list[int], spg: list[float]
    ) -> dict[str, Any]:
        ids_of = self.token_ids
        type_of = {ids_of["image"]: 1, ids_of["video"]: 2, ids_of["audio"]: AUDIO_TYPE_ID}
        markers = [ids_of[k] for k in ("vision_bos", "vision_eos", "audio_bos", "audio_eos")]
        ids, labels, types = tokenize_media(self.tokenizer, text, type_of, markers)
        L = len(ids)
        sample.update(
            input_ids=ids,
            labels=labels,
            position_ids=self.rope_positions(ids, sample, audio_blocks, spg),  # [4, L]
            length=L,
            vision_tokens=int(((types == 1) | (types == 2)).sum()),
            audio_tokens=int((types == AUDIO_TYPE_ID).sum()),
            mm_token_type_ids=types.astype(np.int64),
        )
        return sample


@register_local_processor("qwen2_5_omni")
def _local_omni(out_dir: str, family: str, **options: Any) -> dict:
    from lmms_data.processors._audio import _local_audio

    return _local_audio(out_dir, family, **options)
