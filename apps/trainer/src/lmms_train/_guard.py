"""The divergence guard: non-finite losses and gradient norms, and runs that do not learn.

`trainer_args.on_nonfinite`:

- `stop` (default): the loop reads each step's loss and gradient norm one step late (no host
  synchronisation in the step); the first non-finite value stops the run with one line naming the
  step, the quantity and the last good checkpoint. Saves happen only after their step's values
  were read, and every save checks the weights first (`_checkpoint.weights_finite`), so no
  checkpoint ever holds NaN/inf.
- `skip`: the gradient norm is read on the host before the optimizer step (one synchronisation
  per step); a non-finite one drops the step's update (the optimizer and the schedule do not
  move, the data is consumed) and counts it in `skipped_steps`. More than `max_nonfinite_skips`
  in a row stop the run as above.

Two warnings, once each: a gradient norm exactly 0 for `ZERO_STEPS` steps in a row (nothing is
trained), and a loss within 1% of ln(vocab size), what a uniform guess scores, for `FLAT_STEPS`
steps in a row (the model is not learning).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from lmms_train._errors import DivergenceError

__all__ = ["DivergenceGuard", "drop_update", "vocab_size_of"]

ZERO_STEPS = 3
FLAT_STEPS = 10


def vocab_size_of(hf_config: Any) -> int | None:
    """The output vocabulary of an HF config (top level or its text config)."""
    for conf in (hf_config, getattr(hf_config, "text_config", None)):
        size = getattr(conf, "vocab_size", None)
        if isinstance(size, int) and size > 1:
            return size
    return None


def drop_update(optimizer: torch.optim.Optimizer) -> None:
    """Skip a step's update but run the optimizer's step post-hooks, which keep attached state
    in order (`lmms_parallel.MasterWeights` copies its unchanged masters back and forgets the
    step's pending gradients); the caller zeroes the gradients as after any step."""
    for hook in list(getattr(optimizer, "_optimizer_step_post_hooks", {}).values()):
        hook(optimizer, (), {})


class DivergenceGuard:
    """Checks every step's loss and gradient norm (see the module docstring)."""

    def __init__(
        self,
        *,
        policy: str = "stop",
        max_skips: int = 10,
        vocab_size: int | None = None,
        last_good: Callable[[], str] = lambda: "no checkpoint was written",
        announce: bool = True,
        skipped: int = 0,
    ) -> None:
        self.policy, self.max_skips, self.last_good, self.announce = (
            policy,
            max_skips,
            last_good,
            announce,
        )
        self.flat_loss = math.log(vocab_size) if vocab_size else None
        self.skipped = skipped  # steps whose update was dropped (kept across resumes)
        self._skip_streak = 0
        self._zero_streak = 0
        self._flat_streak = 0
        self._warned: set[str] = set()

    def skip_update(self, step: int, norm: torch.Tensor) -> bool:
        """`skip` policy: read the gradient norm now and say whether to drop the update."""
        if self.policy != "skip":
            return False
        value = float(norm)  # the one host synchronisation this policy costs
        if math.isfinite(value):
            self._skip_streak = 0
            return False
        self.skipped += 1
        self._skip_streak += 1
        if self._skip_streak > self.max_skips:
            raise DivergenceError(
                f"training diverged: the gradient norm was non-finite ({value}) for "
                f"{self._skip_streak} steps in a row up to step {step} (more than "
                f"trainer_args.max_nonfinite_skips={self.max_skips}); {self.last_good()}"
            )
        self._say(f"step {step}: gradient norm {value}, update skipped ({self.skipped} so far)")
        return True

    def check(self, step: int, loss: float, grad_norm: float, *, skipped: bool = False) -> None:
        """After a step's values are read: stop on a non-finite one, warn on a flat run."""
        if not skipped:
            for name, value in (("loss", loss), ("gradient norm", grad_norm)):
                if not math.isfinite(value):
                    other = (
                        f"gradient norm {grad_norm:.4g}" if name == "loss" else f"loss {loss:.4g}"
                    )
                    raise DivergenceError(
                        f"training diverged at step {step}: the {name} is {value} ({other}); "
                        f"nothing after it was saved and {self.last_good()} (lower "
                        "trainer_args.learning_rate or max_grad_norm, check the data near this "
                        "step, or set trainer_args.on_nonfinite: skip)"
                    )
        self._zero_streak = self._zero_streak + 1 if grad_norm == 0.0 else 0
        if self._zero_streak == ZERO_STEPS:
            self._warn_once(
                "zero",
                f"the gradient norm has been exactly 0 for {ZERO_STEPS} steps (to step {step}): "
                "nothing is being trained (every parameter frozen? no supervised tokens?)",
            )
        flat = self.flat_loss is not None and abs(loss - self.flat_loss) < 0.01 * self.flat_loss
        self._flat_streak = self._flat_streak + 1 if flat else 0
        if self._flat_streak == FLAT_STEPS:
            self._warn_once(
                "flat",
                f"the loss has stayed at ln(vocab size) = {self.flat_loss:.3f}, a uniform guess, "
                f"for {FLAT_STEPS} steps (to step {step}): the model is not learning (learning "
                "rate, frozen modules, labels?)",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._say(f"warning: {message}")

    def _say(self, message: str) -> None:
        if self.announce:
            print(f"[lmms-train] {message}", file=sys.stderr, flush=True)
