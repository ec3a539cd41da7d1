"""Metric sinks: JSONL (always), a console progress bar, wandb and TensorBoard (optional).

Only rank 0 writes. Optional back-ends are imported lazily; asking for one that is not
installed raises an ImportError naming the extra (`pip install lmms-train[wandb]`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MetricsLogger",
    "TensorBoardSink",
    "WandbSink",
    "read_jsonl",
]


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible
    return value


class JsonlSink:
    """One JSON object per line per step. On resume, lines after the resumed step are dropped,
    so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, *, resume_step: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and path.exists():
            kept = [r for r in read_jsonl(path) if r.get("step", 0) <= resume_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)
        elif resume_step is None and path.exists():
            path.unlink()
        self._file = path.open("a", buffering=1)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (skips a torn last line)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class ConsoleSink:
    """A tqdm progress bar with the key metrics as postfix; plain lines if tqdm is missing or
    stderr is not a terminal (keeps logs readable under torchrun and in CI)."""

    KEYS = ("loss", "ce", "fm", "lr", "grad_norm", "tokens_per_sec", "mfu")  # ce/fm: bagel's terms

    def __init__(
        self, total: int, initial: int = 0, every: int = 1, passes: int | None = None
    ) -> None:
        self.every = max(1, every)
        self.total = total
        self.passes = passes  # max_steps: -1: the run's passes over the data
        self.initial = initial
        self.started = time.perf_counter()
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total if total > 0 else None, initial=initial,
                                 desc="train", dynamic_ncols=True)  # fmt: skip
            except ImportError:
                self._bar = None

    @staticmethod
    def _fmt(key: str, value: Any) -> str:
        """Readable values: loss 2.3456, lr 2.00e-05, grad_norm 1.23, tokens/s 12.3k, MFU 36.9%."""
        from lmms_train._banner import human

        if not isinstance(value, float):
            return f"{key}={value}"
        if key == "lr":
            return f"lr={value:.2e}"
        if key == "tokens_per_sec":
            return f"tok/s={human(value)}"
        if key.startswith("mfu"):
            return f"{key}={100 * value:.3g}%"
        if key in ("loss", "eval_loss"):
            return f"{key}={value:.4f}"
        return f"{key}={value:#.3g}"

    def _clock(self, step: int) -> str:
        """Elapsed time and the ETA from this process's own pace (resumed steps excluded)."""
        from lmms_train._banner import duration

        elapsed = time.perf_counter() - self.started
        done = step - self.initial
        if self.total <= 0:  # max_steps: -1: the run ends with the data
            return f"elapsed {duration(elapsed)}"
        eta = elapsed / done * max(0, self.total - step) if done > 0 else float("nan")
        return f"elapsed {duration(elapsed)} eta {duration(eta)}"

    def _estimate(self, step: int, metrics: Mapping[str, Any]) -> None:
        """`max_steps: -1`: once the first pass over the data has ended, the run's length is
        estimated as `passes` x the steps that pass took (the ETA counts down to it)."""
        if self.total <= 0 and self.passes and metrics.get("data_passes", 0) >= 1:
            self.total = self.passes * step
            if self._bar is not None:  # the bar's ETA counts down to it too
                self._bar.total = self.total
            print(
                f"[lmms-train] the first pass over the data took {step:,} steps: about "
                f"{self.total:,} steps for {self.passes} pass(es)",
                file=sys.stderr,
                flush=True,
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._estimate(step, metrics)
        shown = {k: _clean(metrics[k]) for k in self.KEYS if k in metrics}
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(
                {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()}
            )
        elif step % self.every == 0 or step == self.total or "eval_loss" in metrics:
            parts = " ".join(self._fmt(k, v) for k, v in shown.items())
            extra = f" eval_loss={metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""
            total = f"/{self.total:,}" if self.total > 0 else ""
            print(
                f"[lmms-train] step {step:,}{total} {parts}{extra} {self._clock(step)}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class WandbSink:
    """wandb, offline unless `mode="online"` (runs land in `<output_dir>/wandb`)."""

    def __init__(
        self, *, project: str, name: str, mode: str, out_dir: Path, config: dict, resume: bool
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "report_to: wandb needs wandb: pip install 'lmms-train[wandb]'"
            ) from exc
        self._run = wandb.init(
            project=project,
            name=name,
            mode=mode,
            dir=str(out_dir),
            config=config,
            resume="allow" if resume else None,
            id=None,
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log({k: _clean(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """TensorBoard scalars under `<output_dir>/tensorboard`."""

    def __init__(self, out_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "report_to: tensorboard needs tensorboard: pip install 'lmms-train[tensorboard]'"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for k, v in metrics.items():
            v = _clean(v)
            if isinstance(v, int | float) and not isinstance(v, bool):
                self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Fans one step's metrics out to every sink; a no-op on ranks other than 0."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
