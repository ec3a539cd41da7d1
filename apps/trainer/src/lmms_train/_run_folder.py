"""One run per output folder: a fresh run never mixes with another run's files.

A run's lineage is a run id, made at its fresh start, carried across resumes (each checkpoint
records it: `lmms_parallel.Checkpointer(run_id=...)` writes a `RUN` file) and written to
`<output_dir>/run.json`. Checkpoint pruning and `resume_from: latest` see only the checkpoints
of that lineage. A fresh run (no `resume_from`) into a folder that holds another run is refused
before anything is built, unless `trainer_args.overwrite_output_dir: true`, which deletes that
run's files (`RUN_ARTIFACTS`) once the new run's model is built (a run that fails to start
leaves the folder as it was).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

__all__ = [
    "RUN_ARTIFACTS",
    "clear_previous_run",
    "fresh_run_problem",
    "new_run_id",
    "previous_run",
    "read_lineage",
    "set_aside_metrics",
    "write_run_file",
]

RUN_FILE = "run.json"
# what a run writes into its output_dir (overwrite_output_dir deletes these, nothing else)
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "metrics.png", "config.yaml", RUN_FILE, "hf",
                 "hf_ema", "tensorboard", "wandb", "profile")  # fmt: skip


def new_run_id() -> str:
    """A run id: the start time and a random suffix (readable, unique across restarts)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def read_lineage(out: Path) -> str | None:
    """The run id of the run `out` holds (None: no `run.json`, e.g. a folder of an older lmms)."""
    try:
        run_id = json.loads((out / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def write_run_file(out: Path, run_id: str, resumed_from: Path | None) -> None:
    record = {"run_id": run_id, "resumed_from": str(resumed_from) if resumed_from else None}
    (out / RUN_FILE).write_text(json.dumps(record) + "\n")


def previous_run(out: Path) -> list[str]:
    """What of an earlier run `out` holds: its checkpoints and logged steps (empty when none: a
    run that stopped before its first step, e.g. on a data error, leaves nothing to protect)."""
    found = []
    ckpts = out / "checkpoints"
    steps = sorted(p.name for p in ckpts.glob("step_*")) if ckpts.is_dir() else []
    if steps:
        more = f" and {len(steps) - 1} more" if len(steps) > 1 else ""
        found.append(f"checkpoints/{steps[-1]}{more}")
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def fresh_run_problem(out: Path, resume_from: str | None, overwrite: bool) -> str | None:
    """Why a run may not start in `out` (a fresh run over another run's files), or None."""
    if resume_from is not None or overwrite:
        return None
    found = previous_run(out)
    if not found:
        return None
    return (
        f"trainer_args.output_dir {str(out)!r} holds another run ({', '.join(found)}): continue "
        "it with trainer_args.resume_from: latest, choose another output_dir, or set "
        "trainer_args.overwrite_output_dir: true to delete that run's files"
    )


def clear_previous_run(out: Path) -> list[str]:
    """Delete an earlier run's files from `out`; returns the names deleted."""
    removed = []
    for name in RUN_ARTIFACTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    for path in sorted(out.glob("metrics.*.jsonl")):  # runs set aside by `set_aside_metrics`
        path.unlink()
        removed.append(path.name)
    return removed


def set_aside_metrics(out: Path, other_run: str) -> None:
    """A run resumed into a folder of another lineage: that run's `metrics.jsonl` is renamed to
    `metrics.<its run id>.jsonl`, so the resumed run's file holds only its own rows."""
    path = out / "metrics.jsonl"
    if path.is_file():
        path.rename(out / f"metrics.{other_run}.jsonl")
