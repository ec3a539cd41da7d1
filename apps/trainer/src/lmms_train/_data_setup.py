"""Data set-up: demo inputs generated on first use, then lmms_data's resumable packed loader.

`prepare_inputs` makes a fresh clone self-contained: when the config says how
(`dataset_config.generate_synthetic`, `model_config.build_local_processor`) and the paths do not
exist, rank 0 generates the synthetic dataset and a small local tokenizer/processor folder
(deterministic, seconds), and every rank waits for it.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any

from lmms_train._dist import DistEnv
from lmms_train._errors import ConfigError, DataChangedError, UserError, suggest
from lmms_train.config import TrainConfig, config_to_dict

__all__ = ["TrainData", "build_data", "data_config", "prepare_inputs"]

TRAINER_KEYS = ("eval_dataset_path", "generate_synthetic")
_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "audio_token_id": "<|AUDIO|>",
    "audio_start_token_id": "<|audio_bos|>",
    "audio_end_token_id": "<|audio_eos|>",
}


def _processor_path(cfg: TrainConfig) -> str | None:
    m = cfg.model_config
    return cfg.dataset_config.processor_path or m.processor_path or m.load_from_pretrained_path


def _exists(path: str | list[str]) -> bool:
    paths = [path] if isinstance(path, str) else path
    from lmms_data import dataset_path_exists  # a glob as lmms-data expands it; URLs too

    return all(dataset_path_exists(p) for p in paths)


def prepare_inputs(cfg: TrainConfig, env: DistEnv, spec: Any) -> dict[str, int] | None:
    """Generate missing demo data / processor (rank 0); return the processor's token ids when
    it was built locally (so a model built from config gets a matching vocabulary)."""
    d, m = cfg.dataset_config, cfg.model_config
    proc = _processor_path(cfg)
    family = d.processor_family or spec.processor_family
    if env.is_main:
        if (
            d.generate_synthetic is not None
            and isinstance(d.dataset_path, str)
            and not _exists(d.dataset_path)
        ):
            _generate(d.generate_synthetic, d.dataset_path, spec)
        if m.build_local_processor and proc and not Path(proc).exists():
            from lmms_data import build_local_processor

            try:
                build_local_processor(proc, family)
            except ValueError as exc:
                raise ConfigError(f"model_config.build_local_processor: {exc}") from exc
    env.barrier()
    if not (m.build_local_processor and proc):
        return None
    return _token_ids(proc, vision=bool(spec.media_keys))


def _generate(g: Any, dataset_path: str, spec: Any) -> None:
    """Synthetic records of `g.kind` (default: the family's `synthetic_kind`, else `omni`, `audio`,
    `vl` or `text` by the media the family takes)."""
    from lmms_data import generate_synthetic

    out = dataset_path if not Path(dataset_path).suffix else str(Path(dataset_path).parent)
    kind = g.kind or spec.synthetic_kind
    if kind in ("shapes", "clips"):  # latent demos (diffusion transformers)
        from lmms_train._latent_data import generate_latent_demo

        return generate_latent_demo(g, out, kind)
    audio, vision = "input_features" in spec.media_keys, "pixel_values" in spec.media_keys
    default = "omni" if audio and vision else "audio" if audio else "vl" if vision else "text"
    generate_synthetic(kind or default, out, g.num_samples, format=g.format, seed=g.seed,
                       image_size=g.image_size)  # fmt: skip
    return None


def _token_ids(path: str, *, vision: bool = True) -> dict[str, int]:
    """Vocabulary size and special-token ids of a local tokenizer (vision tokens only for models
    that take media: a text model's config has no use for them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = {"vocab_size": len(tok)}
    for key, token in _TOKENS.items() if vision else ():
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids[key] = tid
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(tok, key, None) is not None:
            ids[key] = getattr(tok, key)
    return ids


def data_config(cfg: TrainConfig, spec: Any, **overrides: Any) -> Any:
    """`lmms_data.DatasetConfig` from the trainer's `dataset_config` section."""
    from lmms_data import DatasetConfig

    raw = {k: v for k, v in config_to_dict(cfg.dataset_config).items() if k not in TRAINER_KEYS}
    raw["processor_family"] = raw["processor_family"] or spec.processor_family
    raw["processor_path"] = _processor_path(cfg)
    raw.update(overrides)
    known = {f.name for f in dataclasses.fields(DatasetConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:  # the trainer's schema is ahead of lmms_data's: say so instead of dropping keys
        raise ConfigError(
            f"dataset_config: keys {unknown} are not understood by this lmms_data version"
        )
    try:
        return DatasetConfig.from_dict(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"dataset_config: {exc}") from exc


def _unwrap(exc: BaseException) -> tuple[str, str]:
    """`(type name, message)` of a data error, also when a DataLoader worker raised it (torch
    re-raises it in the main process as its traceback text)."""
    text = str(exc)
    if "in DataLoader worker process" not in text:
        return type(exc).__name__, text
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^([\w.]+): (.*)$", lines[i])
        if m and not lines[i].startswith(("Caught ", "Original ")):
            return m.group(1).rsplit(".", 1)[-1], "\n".join([m.group(2), *lines[i + 1 :]])
    return type(exc).__name__, text


class TrainData:
    """The training stream for this rank: packed batches, resumable, with clear data errors.
    `finish(batch)`: the family's last packing step on the host (bagel: rows of parts -> the
    packed row, `spec.finish_pack`); stateless, so the loader's state stays the resume point."""

    def __init__(self, loader: Any, finish: Any = None, *, until_exhausted: bool = False) -> None:
        self.loader, self.finish = loader, finish
        self.until_exhausted = until_exhausted  # max_steps: -1: the run ends with the data

    def __iter__(self):
        it = iter(self.loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                if self.until_exhausted:
                    return
                raise UserError(
                    "the training data ran out before max_steps (set dataset_config.num_epochs: null)"
                ) from None
            except (ValueError, RuntimeError) as exc:
                name, text = _unwrap(exc)
                if name in ("BadRecordRatioExceeded", "BadRecordError"):
                    lines = text.splitlines()
                    example = next((ln.strip() for ln in lines[1:] if ln.strip()), "")
                    head = lines[0].removesuffix("; last examples:")
                    see = (
                        "raise dataset_config.packing_length or shorten the samples; "
                        if "too_long" in head
                        else ""
                    )
                    raise UserError(
                        f"{head}{'; e.g. ' + example if example else ''} ({see}see dataset_config"
                        ".bad_record_policy / max_bad_record_ratio / packing_length)"
                    ) from None
                msg = str(exc)
                if "saved with a different config" in msg:  # a resumed position of other packing
                    raise DataChangedError(
                        f"the checkpoint's data position does not fit this data config: {msg} "
                        "(resume with the dataset_config it was written with)"
                    ) from None
                if "longer than" in msg or "overlong" in msg or "capacity" in msg:
                    raise UserError(
                        f"a sample does not fit dataset_config.packing_length: {msg} "
                        "(raise packing_length or shorten the samples)"
                    ) from None
                raise
            if self.finish is not None:
                try:
                    batch = self.finish(batch)
                except ValueError as exc:
                    raise ConfigError(f"dataset_config: {exc}") from None
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from lmms_data import DatasetChangedError

        try:
            self.loader.load_state_dict(state)
        except DatasetChangedError as exc:
            raise DataChangedError(str(exc)) from None

    def bad_records(self) -> int:
        return int(self.loader.metrics().get("records_bad", 0))

    def passes_done(self) -> int:
        """Passes over the data this rank's loader has finished (the fewest of its workers'
        and sources'; 0 until every worker has made a batch)."""
        state = self.loader.state_dict()
        workers = state.get("workers", {})
        if len(workers) < max(1, int(state.get("num_workers") or 1)):
            return 0
        epochs = [s["epoch"] for w in workers.values() for s in w.get("sources", [])]
        return min(epochs, default=0)


def _check_inputs(cfg: TrainConfig, spec: Any, dcfg: Any) -> None:
    from lmms_data import PROCESSOR_REGISTRY

    d = cfg.dataset_config
    if not _exists(d.dataset_path):
        raise UserError(f"dataset_config.dataset_path: {d.dataset_path!r} does not exist")
    if d.eval_dataset_path is not None and not _exists(d.eval_dataset_path):
        raise UserError(f"dataset_config.eval_dataset_path: {d.eval_dataset_path!r} does not exist")
    names = list(PROCESSOR_REGISTRY.names())
    if dcfg.processor_family not in names:
        raise ConfigError(
            f"no lmms_data processor {dcfg.processor_family!r} for model {spec.name!r}"
            f"{suggest(dcfg.processor_family, names)}; registered processors: {', '.join(names)}"
        )
    if not dcfg.processor_path or not Path(dcfg.processor_path).exists():
        raise UserError(
            f"tokenizer/processor folder {dcfg.processor_path!r} does not exist (set "
            "model_config.processor_path, or build_local_processor: true for a demo tokenizer)"
        )


def _is_data_error(exc: Exception) -> bool:
    """An lmms_data start-up error about the user's files (not a bug): a record/file shape it
    cannot read (DataShapeError), an unreadable file under `bad_record_policy: raise`
    (BadRecordError), a missing, empty or unrecognised file, or too few records for the slots."""
    if isinstance(exc, FileNotFoundError):
        return True
    if type(exc).__name__ in ("DataShapeError", "BadRecordError"):
        return True
    text = str(exc)
    return any(k in text for k in ("holds no records", "cannot detect the format", "got no data"))


def build_data(cfg: TrainConfig, env: DistEnv, spec: Any) -> tuple[TrainData, Any]:
    """This rank's training stream and a callable giving the validation packs (or None)."""
    from lmms_models import GeneratesLatents, MixedGeneration

    if isinstance(spec, GeneratesLatents):  # diffusion transformers: latent batches
        from lmms_train._latent_data import build_latent_data

        return build_latent_data(cfg, env, spec)
    from lmms_data import build_dataloader, build_processor

    dcfg, finish = data_config(cfg, spec), None
    if isinstance(spec, MixedGeneration):  # packed model-side: options from the model config
        dcfg, finish = _model_side_packing(cfg, spec, dcfg, env)
    _check_inputs(cfg, spec, dcfg)
    try:
        processor = build_processor(dcfg.processor_family, dcfg.processor_path, dcfg)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"could not load the processor from {dcfg.processor_path!r}: {exc}"
        ) from exc
    try:
        loader = build_dataloader(dcfg, processor, dp_rank=env.dp_rank, dp_world=env.dp_size)
    except (ValueError, FileNotFoundError) as exc:  # what the files hold, found at discovery
        if not _is_data_error(exc):
            raise
        hint = (
            " (dataset_config.bad_record_policy: raise; with `skip` the file is counted as a bad "
            "record and the rest is read)"
            if type(exc).__name__ == "BadRecordError"
            else ""
        )
        raise UserError(f"dataset_config.dataset_path: {exc}{hint}") from None
    eval_data = None
    d, t = cfg.dataset_config, cfg.trainer_args
    if d.eval_dataset_path is not None and t.eval_steps > 0:
        ecfg = data_config(
            cfg, spec, dataset_path=d.eval_dataset_path, shuffle=False, num_workers=0,
            extra=dcfg.extra,
        )  # fmt: skip

        def eval_data() -> list[dict[str, Any]]:
            fresh = build_dataloader(ecfg, processor, dp_rank=env.dp_rank, dp_world=env.dp_size)
            return list(itertools.islice(iter(TrainData(fresh, finish)), t.eval_batches))

    return TrainData(loader, finish, until_exhausted=t.max_steps < 0), eval_data


def _model_side_packing(cfg: TrainConfig, spec: Any, dcfg: Any, env: DistEnv) -> tuple[Any, Any]:
    """A family that packs model-side (bagel): its processor options derived from the model
    config (`spec.processor_options`, under the user's `dataset_config.extra`) and the host-side
    step that makes each loader row the packed row (`spec.finish_pack`; on CUDA every row padded
    to `packing_length`, so the compiled attention sees one shape)."""
    import functools

    from lmms_train._latent_data import model_config_for_data

    conf = model_config_for_data(cfg, spec)
    try:
        extra = {**spec.processor_options(conf), **dcfg.extra}
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model_config: {exc}") from None
    pad_to = dcfg.packing_length if env.device.type == "cuda" and dcfg.packing else None
    finish = functools.partial(spec.finish_pack, conf, pad_to=pad_to)
    return dataclasses.replace(dcfg, extra=extra), finish
