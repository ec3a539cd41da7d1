"""Configs written for lmms-engine, rewritten as lmms-train configs (`lmms-train convert-config`).

lmms-engine configs come in two shapes: `{trainer_type, dataset_config, model_config,
trainer_args}` and the older list `[{type: trainer, config: {...}}]` whose trainer arguments sit
flat in `config`. Their `trainer_args` are mostly HF `TrainingArguments` (often dumped whole, with
every default). `convert(raw)` maps each key to its lmms-train home, or drops it with the reason,
or reports a problem that names where the setting lives now; nothing is dropped silently and no
unknown key passes. The key map is documented in docs/migrating-from-lmms-engine.md (a test checks
that every key handled here appears there).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmms_train._convert_tables import (
    _ATTENTION,
    _ENGINE_MARKS,
    _HF_DEFAULT_ONLY,
    _LIGER_TOGGLES,
    _SAME_AS_OURS,
    _SECTIONS,
    _TEXT_DATASET_TYPES,
    _TRAINERS,
    _VIDEO_EXTRA,
    DOC,
    _registered_dataset_types,
    engine_chat_dataset_types,
    engine_model_types,
)
from lmms_train._convert_trainer import convert_trainer_args

__all__ = ["Conversion", "accept_engine", "convert", "looks_like_lmms_engine", "render"]


@dataclass(kw_only=True, slots=True)
class Conversion:
    """The lmms-train config, what happened to each key, and what cannot be converted."""

    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # "old -> new (meaning)" / "old: dropped (why)"
    problems: list[str] = field(default_factory=list)  # one line each, naming the new home
    dropped_hf: list[str] = field(default_factory=list)  # HF bookkeeping keys dropped


def looks_like_lmms_engine(raw: Any) -> bool:
    """True for lmms-engine's list form, `trainer_type`, or any lmms-engine-only section key."""
    if isinstance(raw, list):
        return any(isinstance(x, dict) and x.get("type") == "trainer" for x in raw)
    if not isinstance(raw, dict):
        return False
    if "trainer_type" in raw:
        return True
    from lmms_train.config import _schema

    native = {"trainer_args": _schema.TrainerArgs, "dataset_config": _schema.DatasetConfig,
              "model_config": _schema.ModelConfig}  # fmt: skip
    for section, marks in _ENGINE_MARKS.items():
        sec = raw.get(section)
        marks = marks - set(native[section].__dataclass_fields__)  # keys lmms-train also has
        if isinstance(sec, dict) and (marks & set(sec) or sec.get("dataset_format") == "yaml"):
            return True
    return False


def _sections(raw: Any) -> dict[str, Any]:
    """The dict form, with the list form's flat trainer arguments moved into `trainer_args`."""
    if isinstance(raw, list):
        trainer = next(x for x in raw if isinstance(x, dict) and x.get("type") == "trainer")
        cfg = dict(trainer.get("config") or {})
        flat = {
            k: cfg.pop(k)
            for k in list(cfg)
            if k not in (*_SECTIONS, "trainer_type", "extra_kwargs")
        }
        cfg["trainer_args"] = {**flat, **(cfg.get("trainer_args") or {})}
        return cfg
    return dict(raw)


class _Converter:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.out: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        self.c = Conversion()

    def set(self, dotted: str, value: Any, src: str | None = None, why: str = "") -> None:
        section, *path = dotted.split(".")
        node = self.out[section]
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        if src is not None and src != dotted:
            self.c.notes.append(f"{src} -> {dotted}: {value!r}" + (f" ({why})" if why else ""))

    def drop(self, src: str, why: str) -> None:
        self.c.notes.append(f"{src}: dropped ({why})")

    def problem(self, src: str, value: Any, home: str) -> None:
        self.c.problems.append(f"{src}: {value!r} cannot be converted: {home} (see {DOC})")

    # ---- sections ----------------------------------------------------------------------------
    def top(self, raw: dict[str, Any]) -> None:
        for key, value in raw.items():
            if key in _SECTIONS:
                continue
            if key == "trainer_type":
                if _TRAINERS.get(value):
                    self.set("model_config.objective", _TRAINERS[value], key,
                             "lmms-train's one trainer with this objective (docs/diffusion-lm.md)")  # fmt: skip
                elif value in _TRAINERS or value is None:
                    self.drop(key, "lmms-train has one trainer: FSDP2 on several processes, "
                                   "bf16 + fp32 master weights on one")  # fmt: skip
                else:
                    self.problem(key, value, "lmms-train has one trainer whose objective is "
                                 "model_config.objective (causal_lm, masked_diffusion, ...); "
                                 "other trainers (RL, ...) are not ported")  # fmt: skip
            elif key == "extra_kwargs":
                if value:
                    self.problem(key, value, "custom options go to dataset_config.extra")
            else:
                self.unknown(key, value, "top level", ())

    def unknown(self, src: str, value: Any, where: str, known: tuple[str, ...]) -> None:
        close = difflib.get_close_matches(src.rsplit(".", 1)[-1], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        self.c.problems.append(
            f"{src}: unknown key at the {where} ({hint}neither lmms-engine's nor lmms-train's; "
            f"see {DOC})"
        )

    def model(self, m: dict[str, Any]) -> None:
        from lmms_train.config._schema import ModelConfig

        for key, value in m.items():
            src = f"model_config.{key}"
            if key == "attn_implementation":
                if value in _ATTENTION:
                    self.set("trainer_args.attn_backend", _ATTENTION[value], src,
                             "lmms_kernels' varlen attention; auto picks fa4, fa, then torch")  # fmt: skip
                elif value is not None:
                    self.problem(
                        src,
                        value,
                        f"trainer_args.attn_backend, one of {sorted(set(_ATTENTION.values()))}",
                    )
            elif key == "load_from_config" and isinstance(value, dict):
                conf = {k: v for k, v in value.items() if v is not None}
                if conf.get("model_type") in engine_model_types():
                    self.model_type(f"{src}.model_type", conf.pop("model_type"), conf)
                self.set("model_config.load_from_config", conf)
            elif key == "model_type" and value in engine_model_types():
                self.model_type(src, value, None)
            elif key in _SAME_AS_OURS:
                self.same_as_ours(src, key, value)
            elif key == "overwrite_config":
                if value:
                    if isinstance(m.get("load_from_config"), dict):
                        conf = self.out["model_config"].setdefault("load_from_config", {})
                        conf.setdefault("config", {}).update(value)
                        self.c.notes.append(f"{src} -> model_config.load_from_config.config")
                    else:
                        self.problem(src, value, "a pretrained checkpoint loads with its own "
                                     "config.json: edit that file, or use load_from_config")  # fmt: skip
            elif key == "monkey_patch_kwargs":
                self.patches(src, value or {})
            elif key == "extra_kwargs":
                if value:
                    self.problem(src, value, "no model options beyond model_config's keys")
            elif key in ModelConfig.__dataclass_fields__:
                self.set(f"model_config.{key}", value)
            else:
                self.unknown(src, value, "model_config", tuple(ModelConfig.__dataclass_fields__))

    def patches(self, src: str, kw: dict[str, Any]) -> None:
        for key, value in kw.items():
            if key == "patch_type":
                if "liger" in (value or []):
                    self.set("trainer_args.use_liger_kernel", True, f"{src}.patch_type")
                others = [v for v in value or [] if v not in ("liger", "video")]
                if others:
                    self.problem(f"{src}.patch_type", others, "lmms-train applies Liger's "
                                 "kernels (trainer_args.use_liger_kernel) and nothing else")  # fmt: skip
                if "video" in (value or []):
                    self.drop(f"{src}.patch_type", "'video': LLaVA-OneVision's video features "
                              "are part of the llava_onevision family")  # fmt: skip
            elif key == "use_rmpad":
                self.set("trainer_args.use_rmpad", bool(value), f"{src}.use_rmpad")
            elif key == "add_faster_video":
                if value:
                    self.problem(f"{src}.{key}", value, "LLaVA-Video's slow-fast frames are not "
                                 "ported: set it to false")  # fmt: skip
                else:
                    self.drop(f"{src}.{key}", "false: slow-fast frames off, as in lmms-train")
            elif key in _LIGER_TOGGLES:
                self.drop(f"{src}.{key}", _LIGER_TOGGLES[key])
            else:
                self.unknown(f"{src}.{key}", value, "monkey_patch_kwargs",
                             ("patch_type", "use_rmpad", *_LIGER_TOGGLES))  # fmt: skip

    def model_type(self, src: str, value: str, conf: dict[str, Any] | None) -> None:
        """An lmms-engine model type that is an lmms-train family + objective."""
        family, objective = engine_model_types()[value]
        if conf is not None:
            conf["model_type"] = family
            self.c.notes.append(f"{src} -> model_config.load_from_config.model_type: {family!r}")
        else:
            self.set("model_config.model_type", family, src)
        if objective:
            self.set("model_config.objective", objective, src, "the family with this objective")

    def same_as_ours(self, src: str, key: str, value: Any) -> None:
        """A setting at the value lmms-train always uses: a no-op, said in a note."""
        values, note = _SAME_AS_OURS[key]
        if value is None or value in values:
            if value is not None:
                self.drop(src, f"{value!r} is what lmms-train does: {note}")
        else:
            self.problem(src, value, note)

    def dataset(self, d: dict[str, Any]) -> None:
        from lmms_train.config._schema import DatasetConfig

        known = tuple(DatasetConfig.__dataclass_fields__)
        fmt = d.get("dataset_format")
        for key, value in d.items():
            src = f"dataset_config.{key}"
            if key == "dataset_type":
                if value in engine_chat_dataset_types():
                    self.set("dataset_config.dataset_type", "chat", src,
                             "messages / LLaVA / ShareGPT records, detected per record")  # fmt: skip
                elif value in _registered_dataset_types():  # lmms-train's own (e.g. text)
                    self.set("dataset_config.dataset_type", value, src, "registered in lmms-data")
                elif value in _TEXT_DATASET_TYPES:
                    self.set("dataset_config.dataset_type", "text", src,
                             "plain-text records ({'text': ...}) for pretraining")  # fmt: skip
                    self.set("dataset_config.processor_family", "text_pretrain", src,
                             "no chat template, EOS after each document, every token a target")  # fmt: skip
                else:
                    self.problem(src, value, "register a record adapter with "
                                 "@lmms_data.register_dataset and name it in dataset_type")  # fmt: skip
            elif key == "dataset_format":
                if value in ("yaml", "json", "jsonl", "arrow", "hf_dataset", "parquet", None):
                    self.drop(src, "formats come from each file (.json arrays or JSON Lines, "
                                   ".jsonl, .parquet, .arrow, save_to_disk folders)")  # fmt: skip
                else:
                    self.set("dataset_config.dataset_format", value)
            elif key == "dataset_path":
                if fmt == "yaml" and value:
                    self.data_list(src, self.read_yaml_list(src, value))
                elif value:
                    self.set("dataset_config.dataset_path", value)
            elif key == "datasets":
                if value:
                    self.data_list(src, value)
            elif key == "processor_config":
                self.processor(src, value or {})
            elif key in ("fps",):
                self.set("dataset_config.video_fps", value, src)
            elif key == "video_sampling_strategy":
                if value == "frame_num":
                    self.set("dataset_config.video_max_frames", d.get("frame_num", 64), src,
                             "frames sampled at video_fps, capped at this many")  # fmt: skip
                else:
                    self.drop(src, "videos are sampled at dataset_config.video_fps")
            elif key == "frame_num":
                if d.get("video_sampling_strategy") != "frame_num":
                    self.drop(src, "used only with video_sampling_strategy: frame_num")
            elif key == "video_backend":
                self.drop(src, "videos are decoded with PyAV (lmms-data[video])")
            elif key in ("filter_overlong", "filter_overlong_workers", "max_length"):
                self.drop(src, "a sample longer than packing_length is a too_long bad record: "
                               "skipped and counted while streaming, never truncated")  # fmt: skip
            elif key == "extra_kwargs" and d.get("dataset_type") == "llava_video" and value:
                self.video_extra(src, value)
            elif key in ("extra_kwargs", "tokenizer"):
                if value:
                    home = (
                        "dataset_config.extra"
                        if key == "extra_kwargs"
                        else "model_config.processor_path"
                    )
                    self.set(home, value, src)
            elif key in _HF_DEFAULT_ONLY:
                self.default_only(src, key, value)
            elif key in ("packing_strategy", "eval_dataset_path") and value is None:
                continue
            elif key in known:
                self.set(f"dataset_config.{key}", value)
            else:
                self.unknown(src, value, "dataset_config", known)

    def read_yaml_list(self, src: str, path: str) -> list[Any]:
        p = Path(path)
        if not p.is_file() and (self.base / p).is_file():
            p = self.base / p
        if not p.is_file():
            self.problem(src, path, "the data list YAML does not exist")
            return []
        data = yaml.safe_load(p.read_text()) or {}
        self.c.notes.append(f"{src}: read the data list {p}")
        return data.get("datasets", []) if isinstance(data, dict) else data

    def data_list(self, src: str, entries: list[Any]) -> None:
        """`datasets: [{path | json_path, data_folder, data_type, sampling_strategy}]`."""
        paths, folders = [], set()
        for i, e in enumerate(entries):
            where = f"{src}[{i}]"
            if not isinstance(e, dict) or not (e.get("path") or e.get("json_path")):
                self.problem(where, e, "each entry needs path (or json_path)")
                continue
            paths.append(str(e.get("path") or e.get("json_path")))
            folders.add(e.get("data_folder") or "")
            strategy = e.get("sampling_strategy", "all")
            if strategy not in ("all", None):
                self.problem(f"{where}.sampling_strategy", strategy, "lmms-train streams every "
                             "record; weight sources with dataset_config.mixture_weights")  # fmt: skip
            for k in set(e) - {
                "path",
                "json_path",
                "data_folder",
                "data_type",
                "sampling_strategy",
            }:
                self.unknown(f"{where}.{k}", e[k], "data list entry", ("path", "data_folder"))
        if paths:
            self.set("dataset_config.dataset_path", paths if len(paths) > 1 else paths[0], src,
                     "a list is a mixture (mixture_weights optional)")  # fmt: skip
        if len(folders) > 1:
            self.problem(f"{src}[*].data_folder", sorted(folders), "lmms-train has one "
                         "dataset_config.data_folder; make media paths relative to one folder")  # fmt: skip
        elif folders and next(iter(folders)):
            self.set("dataset_config.data_folder", next(iter(folders)), f"{src}[*].data_folder")

    def video_extra(self, src: str, extra: dict[str, Any]) -> None:
        """lmms-engine's LLaVA-Video dataset options."""
        for key, value in extra.items():
            if key in _VIDEO_EXTRA:
                self.set(_VIDEO_EXTRA[key], value, f"{src}.{key}")
            elif key == "force_sample":
                self.drop(f"{src}.{key}", "frames are sampled at dataset_config.video_fps, at most "
                          "video_max_frames of them")  # fmt: skip
            elif key == "add_time_instruction":
                self.drop(f"{src}.{key}", "not ported: prompts get no frame-time instruction")
            else:
                self.set(f"dataset_config.extra.{key}", value, f"{src}.{key}")

    def processor(self, src: str, p: dict[str, Any]) -> None:
        from lmms_data import PROCESSOR_REGISTRY

        for key, value in p.items():
            if key == "processor_name":
                if value:
                    self.set("model_config.processor_path", value, f"{src}.{key}")
                else:
                    self.drop(f"{src}.{key}", "empty: the processor is the model folder's")
            elif key == "processor_type":
                if self.out["dataset_config"].get("processor_family") == "text_pretrain":
                    self.drop(f"{src}.{key}", "plain-text pretraining uses text_pretrain")
                elif value in PROCESSOR_REGISTRY.names():
                    self.set("dataset_config.processor_family", value, f"{src}.{key}",
                             "an lmms_data processor (default: the model family's)")  # fmt: skip
                else:
                    self.drop(f"{src}.{key}", f"{value!r}: the model family's lmms_data "
                              "processor is used")  # fmt: skip
            elif key in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
                self.set(f"dataset_config.{key}", value, f"{src}.{key}")
            elif key in ("extra_kwargs",) and not value:
                continue
            else:
                self.set(f"dataset_config.extra.{key}", value, f"{src}.{key}",
                         "a keyword option of the lmms_data processor")  # fmt: skip

    def pixel_floors(self) -> None:
        """A pixel cap below lmms-train's default floor lowers the floor to it (lmms-engine's
        processors have lower floors; e.g. video_max_pixels: 50176)."""
        from lmms_train.config._schema import DatasetConfig

        out = self.out["dataset_config"]
        for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            floor = DatasetConfig.__dataclass_fields__[lo].default
            if isinstance(out.get(hi), int) and lo not in out and out[hi] < floor:
                self.set(f"dataset_config.{lo}", out[hi], f"dataset_config.{hi}",
                         f"lmms-train's default {lo}, {floor}, is above it")  # fmt: skip

    def default_only(self, src: str, key: str, value: Any) -> None:
        default, home = _HF_DEFAULT_ONLY[key]
        if value == default or (value in (None, [], {}, "", False) and not default):
            return
        if key == "data_seed":
            self.set("dataset_config.seed", value, src)
            return
        self.problem(src, value, home)

    def trainer(self, t: dict[str, Any]) -> None:
        convert_trainer_args(self, t)


def convert(raw: Any, *, base: str | Path = ".") -> Conversion:
    """Map an lmms-engine config (dict or list form) to an lmms-train config dict.

    ``base``: the config's folder (external data-list YAMLs are also looked up there).
    """
    cv = _Converter(Path(base))
    data = _sections(raw)
    cv.top(data)
    for section, handler in (("model_config", cv.model), ("dataset_config", cv.dataset),
                             ("trainer_args", cv.trainer)):  # fmt: skip
        value = data.get(section)
        if isinstance(value, dict):
            handler(value)
        elif value is not None:
            cv.c.problems.append(f"{section}: expected a mapping, got {type(value).__name__}")
    cv.pixel_floors()
    if cv.c.dropped_hf:
        cv.c.notes.append(
            f"{len(cv.c.dropped_hf)} HF Trainer bookkeeping keys dropped (logging, hub, device "
            "and eval-loop settings with no meaning in lmms-train)"
        )
    cv.c.config = {s: v for s, v in cv.out.items() if v}
    return cv.c


def render(conv: Conversion, source: str) -> str:
    """The converted config as YAML, with the key map as a comment header."""
    head = [f"# converted from the lmms-engine config {source} by `lmms-train convert-config`"]
    head += [f"#   {n}" for n in conv.notes]
    body = yaml.safe_dump(conv.config, sort_keys=False, default_flow_style=None)
    return "\n".join(head) + "\n" + body


def accept_engine(raw: Any, path: str | Path) -> Any:
    """`raw` unchanged unless it is an lmms-engine config: then its conversion (a one-line notice
    on stderr from rank 0), or `ConfigError` naming the first key that cannot be converted."""
    if not looks_like_lmms_engine(raw):
        return raw
    import os
    import sys

    from lmms_train._errors import ConfigError

    conv = convert(raw, base=Path(path).parent)
    if conv.problems:
        more = len(conv.problems) - 1
        tail = f" (and {more} more: `lmms-train convert-config {path}` lists them)" if more else ""
        raise ConfigError(f"{path} (an lmms-engine config): {conv.problems[0]}{tail}")
    if os.environ.get("RANK", "0") == "0":
        print(
            f"lmms-train: {path} is an lmms-engine config: read with {len(conv.notes)} keys mapped "
            f"or dropped (`lmms-train convert-config {path}` shows the key map)",
            file=sys.stderr,
            flush=True,
        )
    return conv.config
