"""What the training loop does after a step that went wrong: gradients that are not finite (--on-nan) or a loss
far above its recent mean (--loss-spike-zscore, --on-spike).

Each is said (where it went wrong, how far), then the run stops, skips the step, or rolls back: it reloads the newest
checkpoint of --save and goes on without the offending batch (the loop reads `skip_batch_at`). Rolling back is one
path for both, so a spike and a NaN leave the counters, the metrics and the spike window in the same state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from paratron.config.schema import Config
from paratron.debugging.loss_spike import Spike, SpikeDetector
from paratron.errors import NonFiniteStop
from paratron.training.metrics import MetricsWriter
from paratron.training.resume import ResumePlan, TrainState, rollback_plan
from paratron.training.saving import CheckpointSaver
from paratron.training.step_log import StepWindow


class Recovery:
    """--on-nan and --on-spike for one run: the spike detector, the decisions, the batches a rollback leaves out."""

    def __init__(
        self,
        config: Config,
        writer: MetricsWriter,
        saver: CheckpointSaver,
        restore: Callable[[ResumePlan], None],
    ) -> None:
        t = config.training
        self.config, self.writer, self.saver, self.restore = config, writer, saver, restore
        self.skip_batch_at: set[int] = set()
        """Iterations whose batch a rollback leaves out."""
        self.spikes = SpikeDetector(t.loss_spike_zscore, t.loss_spike_window) if t.loss_spike_zscore else None
        self.spike: Spike | None = None
        """The loss spike of the step just run, if it was one (taken by the loop with `take_spike`)."""

    def judge_loss(self, step: int, loss: float) -> bool:
        """--loss-spike-zscore, before the optimizer steps: step `step`'s global loss judged (the same on every
        rank); True withholds the step (--on-spike skip or rollback)."""
        assert self.spikes is not None
        self.spike = self.spikes.judge(step, loss)
        return self.spike is not None and self.config.training.on_spike != "warn"

    def take_spike(self) -> Spike | None:
        spike, self.spike = self.spike, None
        return spike

    def after_nonfinite(self, iteration: int, where: str, state: TrainState, window: StepWindow) -> bool:
        """--on-nan after a step whose gradients were not finite (it was not applied): say where,
        then stop, skip the batch, or reload the newest checkpoint (True: rolled back)."""
        how = self.config.training.on_nan
        what = f"step {iteration}: the gradients are not finite; first non-finite: {where}"
        save = self.config.checkpoint.save
        if how == "skip":
            state.skipped_iterations += 1
            self.writer.info(f"{what}; step skipped (--on-nan skip)")
            return False
        if how == "rollback" and save:
            if self._roll_back(iteration, what, "--on-nan rollback", window):
                return True
            what += "; no checkpoint in --save to roll back to"
        elif how == "rollback":
            what += "; --on-nan rollback needs --save"
        raise NonFiniteStop(f"{what}; stopped (--on-nan {how})")

    def after_spike(self, spike: Spike, state: TrainState, window: StepWindow) -> bool:
        """--on-spike after a loss spike: say it, then the step stays applied (warn), is skipped, or training goes
        back to the newest checkpoint without the batch (True: rolled back; skipped when there is no checkpoint)."""
        how, what = self.config.training.on_spike, spike.describe()
        if how == "rollback" and self._roll_back(spike.step, what, "--on-spike rollback", window):
            return True
        if how != "warn":
            state.skipped_iterations += 1
        self.writer.info(f"{what}; {spike.outcome(how, state.skipped_iterations)}")
        return False

    def _roll_back(self, iteration: int, what: str, why: str, window: StepWindow) -> bool:
        """Reload the newest checkpoint of --save and go on without step `iteration`'s batch (False: there is none)."""
        self.saver.finish()
        plan = rollback_plan(Path(self.config.checkpoint.save or ""))
        if plan.checkpoint is None:
            return False
        self.writer.info(f"{what}; back to {plan.checkpoint.path}, without this step's batch ({why})")
        self.restore(plan)
        self.skip_batch_at.add(iteration)
        self.writer.rewind(plan.checkpoint.iteration)
        window.restart()
        if self.spikes is not None:
            self.spikes.rewind(plan.checkpoint.iteration)
        return True
