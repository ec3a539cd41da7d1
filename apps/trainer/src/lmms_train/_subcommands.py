"""`lmms-train check-data`, `convert-config`, `sample` and `--version` (registered in `cli.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from lmms_train._cli_args import take_option
from lmms_train._diffusion_cli import PRECOMPUTE_USAGE, RENDER_USAGE, precompute_main, render_main
from lmms_train._errors import ConfigError, UserError
from lmms_train._launch import USAGE as LAUNCH_USAGE
from lmms_train._plan import PLAN_USAGE

__all__ = [
    "SUBCOMMANDS",
    "USAGES",
    "check_data_main",
    "convert_config_main",
    "sample_main",
    "version_main",
]

CHECK_USAGE = "usage: lmms-train check-data CONFIG.yaml [section.key=value ...] [--num-records N]"
CONVERT_USAGE = "usage: lmms-train convert-config ENGINE_CONFIG.yaml [-o OUT.yaml]"


def check_data_main(args: list[str]) -> int:
    """Process the first N records of CONFIG's data and print the report (exit 0)."""
    from lmms_train._check_data import check_data
    from lmms_train.config import load_config

    args, n = take_option(args, "--num-records", CHECK_USAGE)
    if not args or "=" in args[0]:
        raise UserError(CHECK_USAGE)
    try:
        num = int(n) if n is not None else 200
    except ValueError:
        raise UserError(f"--num-records: expected an integer, got {n!r}") from None
    cfg = load_config(args[0], args[1:])
    from lmms_train._hub_ids import raise_hub_problems

    raise_hub_problems(cfg)  # Hub ids -> local cache folders
    print(check_data(cfg, num).text(), flush=True)
    return 0


def convert_config_main(args: list[str]) -> int:
    """Print (or write with -o) the lmms-train version of an lmms-engine config; exit 2 with one
    line per key that cannot be converted."""
    from lmms_train._convert_config import convert, render

    args, out = take_option(args, "-o", CONVERT_USAGE)
    if len(args) != 1:
        raise UserError(CONVERT_USAGE)
    path = Path(args[0])
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML in {path}: {' '.join(str(exc).split())}") from None
    conv = convert(raw, base=path.parent)
    if conv.problems:
        raise ConfigError("\n".join(conv.problems))
    text = render(conv, str(path))
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)
        print(
            f"lmms-train: wrote {out} ({len(conv.notes)} keys mapped or dropped)", file=sys.stderr
        )
    return 0


def version_main(args: list[str]) -> int:
    """`lmms-train --version`: this app's version and those it runs with."""
    from importlib import metadata

    names = ("lmms-train", "lmms-data", "lmms-models", "lmms-parallel", "lmms-kernels",
             "lmms-optim", "lmms-pack", "torch", "transformers")  # fmt: skip
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    print(", ".join(found))
    return 0


SAMPLE_USAGE = (
    "usage: lmms-train sample CHECKPOINT_DIR --prompt TEXT [--processor DIR] [--gen-length N] "
    "[--steps N] [--block-length N] [--temperature T] [--mask-token-id ID] [--raw] [--show-steps]"
)


def _check_sample_options(nums: dict[str, float]) -> None:
    """`sample`'s numbers, all problems at once (ConfigError), before any work."""
    import math

    gen, steps = int(nums.get("--gen-length", 32)), int(nums.get("--steps", 32))
    block = int(nums.get("--block-length", gen))
    problems = [
        f"{k} must be >= 1, got {int(nums[k])}"
        for k in ("--gen-length", "--steps", "--block-length")
        if k in nums and nums[k] < 1
    ]
    temp = nums.get("--temperature", 0.0)
    if not (math.isfinite(temp) and temp >= 0):
        problems.append(f"--temperature must be a finite number >= 0 (0: greedy), got {temp}")
    if nums.get("--mask-token-id", 0) < 0:
        problems.append(f"--mask-token-id must be >= 0, got {int(nums['--mask-token-id'])}")
    if not problems and gen % block:
        problems.append(f"--gen-length {gen} must be a multiple of --block-length {block}")
    elif not problems and (steps % (gen // block) or steps < gen // block):
        problems.append(f"--steps {steps} must be a positive multiple of the {gen // block} blocks")
    if problems:
        raise ConfigError([f"sample: {p}" for p in problems])


def sample_main(args: list[str]) -> int:
    """Decode text from a masked-diffusion checkpoint folder (iterative unmasking, low-confidence
    remasking; docs/diffusion-lm.md) and print it."""
    opts: dict[str, str | None] = {}
    for name in ("--prompt", "--processor", "--gen-length", "--steps", "--block-length",
                 "--temperature", "--mask-token-id"):  # fmt: skip
        args, opts[name] = take_option(args, name, SAMPLE_USAGE)
    flags = {f for f in ("--raw", "--show-steps") if f in args}
    args = [a for a in args if a not in flags]
    if len(args) != 1 or opts["--prompt"] is None:
        raise UserError(SAMPLE_USAGE)
    try:
        nums = {k: (float if k == "--temperature" else int)(v) for k, v in opts.items()
                if v is not None and k not in ("--prompt", "--processor")}  # fmt: skip
    except ValueError as exc:
        raise UserError(f"{SAMPLE_USAGE}\n{exc}") from None
    _check_sample_options(nums)  # before the checkpoint or the tokenizer is read
    from lmms_train._hub_ids import resolve_path_arg
    from lmms_train._sample import sample_text

    text = sample_text(
        resolve_path_arg(args[0], "model", "CHECKPOINT_DIR"),
        opts["--prompt"],
        processor=resolve_path_arg(opts["--processor"], "processor", "--processor"),
        gen_length=int(nums.get("--gen-length", 32)),
        steps=int(nums.get("--steps", 32)),
        block_length=int(nums["--block-length"]) if "--block-length" in nums else None,
        temperature=float(nums.get("--temperature", 0.0)),
        mask_token_id=int(nums["--mask-token-id"]) if "--mask-token-id" in nums else None,
        chat="--raw" not in flags,
        show_steps="--show-steps" in flags,
    )
    print(text, flush=True)
    return 0


def plan_main(args: list[str]) -> int:
    """`lmms-train plan CONFIG.yaml [...]`: the memory plan (lmms_train._plan)."""
    from lmms_train._plan import plan_main as run

    return run(args)


def launch_main(args: list[str]) -> int:
    """`lmms-train launch`: torchrun with the workers' exit codes kept (`_launch`)."""
    from lmms_train._launch import launch_main as run

    return run(args)


# name: (function, the usage `lmms-train NAME --help` prints (cli.py))
_COMMANDS = {
    "launch": (launch_main, LAUNCH_USAGE),
    "plan": (plan_main, PLAN_USAGE),
    "render": (render_main, RENDER_USAGE),
    "precompute": (precompute_main, PRECOMPUTE_USAGE),
    "sample": (sample_main, SAMPLE_USAGE),
    "check-data": (check_data_main, CHECK_USAGE),
    "convert-config": (convert_config_main, CONVERT_USAGE),
    "--version": (version_main, "usage: lmms-train --version"),
    "-V": (version_main, "usage: lmms-train -V"),
}
SUBCOMMANDS = {name: fn for name, (fn, _) in _COMMANDS.items()}
USAGES = {name: usage for name, (_, usage) in _COMMANDS.items()}
