"""`lmms-train render` and `lmms-train precompute`: the diffusion families' two extra commands.

    lmms-train render CHECKPOINT_DIR --out FILE [--steps N] [--method euler|heun] [--guidance W]
        [--seed S] [--per-class N] [--classes 0,1,..] [--prompt TEXT ... --processor DIR]
        [--frames F --height H --width W] [--objective-args JSON]
    lmms-train precompute CONFIG.yaml --out DIR [--rows-per-shard N] [section.key=value ...]

`render` integrates the probability-flow ODE (``lmms_models._flow_matching.ode_sample``) from a
trained checkpoint folder (the run's ``hf/``; the run's ``config.yaml`` next to it gives the
objective's options) and writes a PNG grid (SiT: one row per class) or a GIF/MP4 (Wan: one clip
per prompt, side by side; BAGEL: one image per prompt, side by side), decoding through the VAE when
the model has one.

`precompute` runs the frozen encoders of CONFIG's model over its dataset once (in order, one
epoch) and writes Parquet shards of ``latents`` and ``label`` / ``text_embeds`` (npy bytes), which
the latent loader reads back: large runs then never hold a VAE or a text encoder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lmms_train._errors import UserError

__all__ = ["precompute_main", "render_main"]

RENDER_USAGE = (
    "usage: lmms-train render CHECKPOINT_DIR --out FILE.png|.gif|.mp4 [--steps N] "
    "[--method euler|heun] [--guidance W] [--seed S] [--per-class N] [--classes 0,1,..] "
    "[--prompt TEXT]... [--processor DIR] [--frames F] [--height H] [--width W] "
    "[--objective-args JSON]"
)
PRECOMPUTE_USAGE = (
    "usage: lmms-train precompute CONFIG.yaml --out DIR [--rows-per-shard N] [section.key=value]"
)


def _options(args: list[str], names: tuple[str, ...], usage: str) -> tuple[list[str], dict]:
    opts: dict[str, Any] = {"--prompt": []}
    rest: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in names:
            if i + 1 >= len(args):
                raise UserError(usage)
            if args[i] == "--prompt":
                opts["--prompt"].append(args[i + 1])
            else:
                opts[args[i]] = args[i + 1]
            i += 2
        else:
            rest.append(args[i])
            i += 1
    return rest, opts


def _spec_of(folder: Path) -> Any:
    from lmms_models import get_model_spec, list_models

    conf_file = folder / "config.json"
    if not conf_file.is_file():
        conf_file = folder / "transformer" / "config.json"
    if not conf_file.is_file():
        raise UserError(f"{folder}: no config.json (give a run's hf/ folder)")
    conf = json.loads(conf_file.read_text())
    name = conf.get("model_type")
    owners = [
        n for n in list_models() if conf.get("_class_name") in get_model_spec(n).folder_class_names
    ]
    if owners:  # a diffusers folder (no model_type): the family that loads its class
        name = owners[0]
    try:
        return get_model_spec(str(name))
    except KeyError as exc:
        raise UserError(f"{folder}: not a diffusion checkpoint ({exc.args[0]})") from None


def _objective_config(spec: Any, folder: Path, override: dict[str, Any] | None) -> Any:
    """The flow-matching options the run trained with: the run's config.yaml (next to hf/),
    over the family's defaults; ``--objective-args`` JSON wins."""
    import yaml

    from lmms_models._flow_matching import FlowMatchingConfig

    args = dict(spec.objective_defaults)
    run_cfg = folder.parent / "config.yaml"
    if run_cfg.is_file():
        model_cfg = (yaml.safe_load(run_cfg.read_text()) or {}).get("model_config", {})
        args.update(model_cfg.get("objective_args") or {})
    if override:
        args.update(override)
    args.pop("cfg_dropout", None)
    try:
        return FlowMatchingConfig(**args)
    except (TypeError, ValueError) as exc:
        raise UserError(f"render: the flow-matching options: {exc}") from None


_MEDIA_SUFFIXES = (".png", ".gif", ".mp4")
_RENDER_INTS = {"--steps": 32, "--seed": 0, "--per-class": 4, "--frames": 9, "--height": 32,
                "--width": 32}  # fmt: skip


def _render_options(o: dict[str, Any]) -> dict[str, Any]:
    """The render options parsed and checked before any work (all problems in one report)."""
    import importlib.util
    import math

    problems: list[str] = []
    vals: dict[str, Any] = {}
    for name, default in _RENDER_INTS.items():
        try:
            vals[name] = int(o.get(name, default))
        except ValueError:
            problems.append(f"{name}: expected an integer, got {o[name]!r}")
            continue
        low = 0 if name == "--seed" else 1
        if vals[name] < low:
            problems.append(f"{name} must be >= {low}, got {vals[name]}")
    try:
        vals["--guidance"] = float(o.get("--guidance", 1.0))
        if not (math.isfinite(vals["--guidance"]) and vals["--guidance"] >= 0):
            problems.append(f"--guidance must be a finite number >= 0, got {o['--guidance']}")
    except ValueError:
        problems.append(f"--guidance: expected a number, got {o['--guidance']!r}")
    vals["--method"] = o.get("--method", "euler")
    if vals["--method"] not in ("euler", "heun"):
        problems.append(f"--method: {vals['--method']!r} is not one of euler, heun")
    try:
        classes = o["--classes"].split(",") if "--classes" in o else None
        vals["--classes"] = None if classes is None else tuple(int(c) for c in classes)
        if vals["--classes"] is not None and min(vals["--classes"]) < 0:
            problems.append(f"--classes: class labels are >= 0, got {o['--classes']!r}")
    except ValueError:
        problems.append(f"--classes: expected integers like 0,1,2, got {o['--classes']!r}")
    try:
        vals["--objective-args"] = (
            json.loads(o["--objective-args"]) if "--objective-args" in o else None
        )
        if vals["--objective-args"] is not None and not isinstance(vals["--objective-args"], dict):
            problems.append("--objective-args: expected a JSON object")
    except ValueError as exc:
        problems.append(f"--objective-args: not JSON: {exc}")
    suffix = Path(o["--out"]).suffix.lower()
    if suffix not in _MEDIA_SUFFIXES:
        problems.append(
            f"--out {o['--out']!r}: the file type comes from its suffix: {', '.join(_MEDIA_SUFFIXES)}"
        )
    elif suffix == ".mp4" and importlib.util.find_spec("av") is None:
        problems.append("--out .mp4 needs PyAV (pip install av); or write a .gif")
    if problems:
        from lmms_train._errors import ConfigError

        raise ConfigError([f"render: {p}" for p in problems])
    return vals


def render_main(args: list[str]) -> int:
    names = ("--out", "--steps", "--method", "--guidance", "--seed", "--per-class", "--classes",
             "--prompt", "--processor", "--frames", "--height", "--width", "--objective-args")  # fmt: skip
    rest, o = _options(args, names, RENDER_USAGE)
    if len(rest) != 1 or "--out" not in o:
        raise UserError(RENDER_USAGE)
    v = _render_options(o)  # before any model code is imported
    import functools

    import torch

    from lmms_data import build_processor
    from lmms_models import GeneratesLatents, RenderRequest, Renders
    from lmms_train._hub_ids import resolve_path_arg
    from lmms_train._render import write_media

    folder = Path(resolve_path_arg(rest[0], "model", "CHECKPOINT_DIR") or rest[0])
    if "--processor" in o:
        o["--processor"] = resolve_path_arg(o["--processor"], "processor", "--processor")
    spec = _spec_of(folder)
    if not isinstance(spec, Renders):
        raise UserError(f"{folder}: {spec.name} does not render (lmms_models.Renders)")
    fm = None  # a latent denoiser samples the ODE of the run's flow-matching options
    if isinstance(spec, GeneratesLatents):
        fm = _objective_config(spec, folder, v["--objective-args"])
    request = RenderRequest(
        folder=str(folder), processor=o.get("--processor"),
        build_processor=functools.partial(build_processor, spec.processor_family),
        prompts=tuple(o["--prompt"] or [""]), classes=v["--classes"],
        per_class=v["--per-class"], frames=v["--frames"], height=v["--height"],
        width=v["--width"], steps=v["--steps"], method=v["--method"],
        guidance=v["--guidance"], seed=v["--seed"], flow_matching=fm,
    )  # fmt: skip
    model = spec.build(pretrained=str(folder)).eval()
    try:
        with torch.no_grad():
            path = write_media(spec.render(model, request), o["--out"])
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(f"lmms-train: wrote {path}", file=sys.stderr)
    return 0


def precompute_main(args: list[str]) -> int:
    rest, o = _options(args, ("--out", "--rows-per-shard"), PRECOMPUTE_USAGE)
    if not rest or "=" in rest[0] or "--out" not in o:
        raise UserError(PRECOMPUTE_USAGE)
    from lmms_train.config import load_config

    cfg = load_config(rest[0], rest[1:])  # config errors before the model code is imported
    from lmms_train._render import precompute

    n, shards = precompute(cfg, o["--out"], rows_per_shard=int(o.get("--rows-per-shard", 512)))
    print(f"lmms-train: wrote {n} records to {shards} shard(s) in {o['--out']}", file=sys.stderr)
    return 0
