"""`lmms-train plot RUN_DIR`: loss, MFU and throughput curves from metrics.jsonl to PNG."""

from __future__ import annotations

from pathlib import Path

from lmms_train._errors import UserError
from lmms_train._metrics import read_jsonl

__all__ = ["plot_run"]

_PANELS = (
    ("loss", "loss", ("loss", "eval_loss", "ce", "fm")),  # ce / fm: ce_flow_matching's terms
    ("lr", "learning rate", ("lr",)),
    ("grad_norm", "gradient norm", ("grad_norm",)),
    ("mfu", "MFU", ("mfu", "mfu_lm")),
    ("throughput", "tokens / s", ("tokens_per_sec",)),
    ("loss_t", "loss per noise level (flow matching)", ("loss_t/*", "fm_loss_t/*")),
)
_COLS = 3


def _expand(keys: tuple[str, ...], records: list[dict]) -> list[str]:
    """Keys with a trailing `*` stand for every metric with that prefix (sorted)."""
    out: list[str] = []
    for key in keys:
        if key.endswith("*"):
            out += sorted({k for r in records for k in r if k.startswith(key[:-1])})
        else:
            out.append(key)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves into one PNG (default `<run_dir>/metrics.png`) and return its path."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(
            f"no metrics.jsonl in {run_dir} (is it a run folder written by lmms-train?)"
        )
    records = read_jsonl(path)
    if not records:
        raise UserError(f"{path} is empty")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(_PANELS) // _COLS)
    fig, grid = plt.subplots(rows, _COLS, figsize=(5 * _COLS, 3.4 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(_PANELS) :]:
        ax.set_visible(False)
    for ax, (_, title, keys) in zip(axes, _PANELS, strict=False):
        for key in _expand(keys, records):
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if key == "eval_loss" else None, ms=3, label=key)
        if not ax.lines:  # e.g. no flow-matching buckets in a language-model run
            ax.set_visible(False)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
