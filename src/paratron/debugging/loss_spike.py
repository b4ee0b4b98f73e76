"""Loss spikes (`--loss-spike-zscore Z --loss-spike-window W --on-spike warn|skip|rollback`).

A step's loss (the global one: averaged over data-parallel ranks, so every rank judges the same number) is a spike
when it lies more than Z standard deviations above the mean of the last W losses that were not spikes themselves.
Nothing is judged until W losses are in the window; a spike does not enter it, so a run of spikes is measured
against the calm before them. A non-finite loss is left to --on-nan. After a rollback the losses of the steps being
done again leave the window (`rewind`), so no step counts twice.

The detector is pure arithmetic on host numbers; the trainer asks it before the optimizer step, so that a spike can
be withheld (`skip`, `rollback`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Spike:
    """A step whose loss stood out of the window."""

    step: int
    loss: float
    mean: float
    std: float
    zscore: float

    def describe(self) -> str:
        """One line naming the step, its loss and how far it stands out."""
        return (
            f"step {self.step}: loss spike: loss {self.loss:.4f} against a mean of {self.mean:.4f} "
            f"(std {self.std:.4f}) over the last steps, z-score {self.zscore:.1f}"
        )

    def outcome(self, how: str, skipped: int) -> str:
        """What became of the step under --on-spike `how` (a rollback with no checkpoint yet skips it)."""
        if how == "warn":
            return "applied (--on-spike warn)"
        why = "no checkpoint in --save yet to roll back to, so " if how == "rollback" else ""
        return f"{why}step skipped ({skipped} skipped so far, --on-spike {how})"


class SpikeDetector:
    """The window of recent non-spike losses and the z-score test of a new one."""

    def __init__(self, zscore: float, window: int) -> None:
        if zscore <= 0 or window < 2:
            raise ValueError("a loss-spike detector needs a z-score above 0 and a window of at least 2 steps")
        self.threshold = zscore
        self.size = window
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)
        """(step, loss) of the last non-spike steps, oldest first."""

    def statistics(self) -> tuple[float, float]:
        """Mean and (population) standard deviation of the window's losses."""
        losses = [loss for _, loss in self.recent]
        mean = math.fsum(losses) / len(losses)
        return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in losses) / len(losses))

    def judge(self, step: int, loss: float) -> Spike | None:
        """The spike `loss` at `step` is, or None (then the loss joins the window)."""
        if not math.isfinite(loss):
            return None
        if len(self.recent) == self.size:
            mean, std = self.statistics()
            excess = loss - mean
            zscore = excess / std if std > 0 else (math.inf if excess > 0 else 0.0)
            if zscore > self.threshold:
                return Spike(step, loss, mean, std, zscore)
        self.recent.append((step, loss))
        return None

    def rewind(self, iteration: int) -> None:
        """Forget the losses of steps after `iteration` (training went back to its checkpoint)."""
        while self.recent and self.recent[-1][0] > iteration:
            self.recent.pop()
