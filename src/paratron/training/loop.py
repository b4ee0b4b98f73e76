"""The training loop: a short loop over named steps (train, log, evaluate, save, profile).

Everything it needs is built beforehand (`training/run.py`); this file only runs it. What a logged
step records is `training/step_log.py`'s, how a run continues or rolls back `training/resume.py`'s.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from paratron.config.layout import BatchPlan, Layout
from paratron.config.samples import batch_schedule
from paratron.config.schema import Config
from paratron.data.build import DataBundle
from paratron.data.loader import DocumentLayout, micro_batches
from paratron.debugging.loss_spike import Spike
from paratron.distributed.init import DistributedContext, release_unused_memory
from paratron.distributed.launch import restart_count
from paratron.distributed.topology import Axis, Topology
from paratron.distributed.watchdog import Watchdog
from paratron.model.batch import Batch
from paratron.optim.lr_schedule import LRSchedule
from paratron.optim.mixed_precision import Precision, build_loss_scaler
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.data_parallel.fully_sharded import reshard
from paratron.parallel.model import ParallelModel
from paratron.parallel.pipeline.schedules import build_schedule
from paratron.training.exit import ExitConditions
from paratron.training.faults import AttemptFault, check_spike_fault
from paratron.training.instruments import StepInstruments
from paratron.training.metrics import TASK_PREFIX, MetricsWriter, ProgressLog
from paratron.training.nonfinite import first_report, watching
from paratron.training.plot import plot_expert_load
from paratron.training.profiling import collect_around_eval
from paratron.training.recovery import Recovery
from paratron.training.resume import Restorer, ResumePlan, TrainState
from paratron.training.saving import CheckpointSaver
from paratron.training.step import StepOptions, StepResult, train_step
from paratron.training.step_log import StepLogger, StepWindow
from paratron.training.validation_loss import task_loss_sums, validation_batches

if TYPE_CHECKING:  # (imported when --eval-tasks first runs, for start-up speed: lm_eval)
    from paratron.inference.tasks import TrainingTasks


class Trainer:
    """Runs the training steps of a built run, logging, evaluating and saving on the way."""

    def __init__(
        self,
        config: Config,
        ctx: DistributedContext,
        topology: Topology,
        layout: Layout,
        model: ParallelModel,
        optimizer: TrainingOptimizer,
        data: DataBundle,
        writer: MetricsWriter,
        flops_per_token: float,
        peak_flops: float,
        state: TrainState | None = None,
    ) -> None:
        t, d, lg = config.training, config.data, config.logging
        self.config, self.ctx, self.topology, self.layout = config, ctx, topology, layout
        self.model, self.optimizer, self.data, self.writer = model, optimizer, data, writer
        self.flops_per_token = flops_per_token
        self.state = state if state is not None else TrainState()
        self.watchdog: Watchdog | None = None
        """Told of every step and save; a loop that stops moving is reported (distributed/watchdog.py)."""
        self.progress: ProgressLog | None = None
        """--log-progress: told of every saved checkpoint."""
        self.plan = layout.batches(topology.dp_rank)
        self.schedule = LRSchedule.of(config, layout.global_batch_size)
        self.ramp = batch_schedule(t, layout.global_batch_size, d.seq_length)  # (a changing batch: None without)
        self.precision = Precision(t.precision, build_loss_scaler(t), ctx.device)
        tokenizer = data.tokenizer
        self.documents = DocumentLayout.of(d, config.model, tokenizer.eod_id if tokenizer is not None else None)
        self.per_token_loss = t.calculate_per_token_loss if t.calculate_per_token_loss is not None else d.sft
        self.fault = AttemptFault(t.fault_inject, restart_count(), ctx.rank)
        check_spike_fault(t.fault_inject, restart_count(), ctx.rank, model.module, topology.group(Axis.WORLD))
        loss_scale = lambda: self.precision.loss_scale  # noqa: E731
        self.instruments = StepInstruments(
            config, ctx, topology, model, optimizer, loss_scale, layout.global_batch_size, writer.info
        )
        """The debugging and measuring flags' instruments (training/instruments.py)."""
        capture, self.timers = self.instruments.capture, self.instruments.timers
        self.step_options = StepOptions(
            check_nonfinite=t.check_for_nan_in_loss_and_grad,
            count_zeros=lg.log_num_zeros_in_grad,
            timers=self.timers,
            empty_unused_memory_level=t.empty_unused_memory_level,
            device=ctx.device,
            after_grads=capture.gradients if capture is not None else None,
        )
        self.logger = StepLogger(
            config, ctx, topology, model, optimizer, self.precision, writer, self.timers, flops_per_token, peak_flops
        )
        self.logger.stragglers = self.instruments.stragglers
        self.restorer = Restorer(config, model, optimizer, topology, self.precision, writer.info)
        self.saver = CheckpointSaver(config, topology, model, optimizer, data.tokenizer, self.restorer, writer)
        self.eval_tasks: TrainingTasks | None = None
        """--eval-tasks' runner, made at the first evaluation."""
        self.recovery = Recovery(config, writer, self.saver, self.restore)
        """--on-nan and --on-spike: stop, skip or roll back after a step that went wrong."""
        if self.recovery.spikes is not None:
            self.step_options.withhold = self._judge_loss

    @property
    def global_batch_size(self) -> int:
        return self.layout.global_batch_size

    @property
    def peak_flops(self) -> float:
        """The peak MFU is measured against (raised when a step runs faster)."""
        return self.logger.peak_flops

    def restore(self, plan: ResumePlan) -> None:
        """Go on where `plan` says: counters, generators, optimizer state and schedule."""
        self.schedule = self.restorer.restore(plan, self.state, self.schedule, self.global_batch_size)

    def fit(self, stop_after: int | None = None) -> TrainState:
        """Train from the state's iteration to --train-iters (or only to `stop_after`; the
        learning-rate schedule still spans --train-iters)."""
        end = stop_after or self.config.training.train_iters
        first = self.state.iteration + 1
        window = StepWindow(self.ctx.device)
        with ExitConditions(self.config.training, self.ctx.device) as exits, self.instruments.stragglers.instrumented():
            iteration = first - 1
            while iteration < end:
                iteration += 1
                self._moved(iteration)
                lr, result = self._train(iteration, first, window)
                self._moved(iteration)
                recovery = self.recovery
                if result.nonfinite and recovery.after_nonfinite(iteration, result.nonfinite_where, self.state, window):
                    iteration = self.state.iteration  # rolled back: go on after the checkpoint
                    continue
                spike = recovery.take_spike()
                if spike is not None and recovery.after_spike(spike, self.state, window):
                    iteration = self.state.iteration
                    continue
                stopping = exits.reason(iteration)
                last = iteration == end
                extra = self._step_extra(self._evaluate_tasks(iteration, last, window), spike)
                if iteration % self.config.logging.log_interval == 0 or last or stopping or extra is not None:
                    self.logger.log(iteration, lr, result, window, self.state, extra)
                self._evaluate(iteration, last, window)
                self._save(iteration, last or bool(stopping), window)
                if stopping and not last:
                    self.writer.info(
                        f"stopping after step {iteration} of {self.config.training.train_iters}: {stopping}"
                    )
                    break
        self.saver.finish()
        self.model.wait_param_gather()
        if self.logger.expert_load and self.ctx.is_main:
            figure = plot_expert_load(self.logger.expert_load, Path(self.config.logging.run_dir))
            self.writer.info(f"expert load: {figure}")
        return self.state

    # ---------------------------------------------------------------- the named steps

    def _train(self, iteration: int, first: int, window: StepWindow) -> tuple[float, StepResult]:
        """One optimizer step (measuring memory on the first with --log-memory, profiling the
        pipeline on the last with --profile-pipeline)."""
        lg, state = self.config.logging, self.state
        lr = self.schedule.apply(self.optimizer.param_groups, state.lr_samples)
        if iteration in self.recovery.skip_batch_at:  # rolled back past it: its batch made the step go wrong
            self.recovery.skip_batch_at.discard(iteration)
            state.consumed_samples += self._plan_at(state.consumed_samples).global_batch_size
        plan = self._plan_at(state.consumed_samples)
        stats = self.instruments.layer_stats
        self.step_options.layer_stats = stats if stats.due(iteration) else None
        with self.timers.time("batch-generator"):
            batches = micro_batches(self.data.train, plan, state.consumed_samples, self.ctx.device, self.documents)
        instruments = self.instruments
        profiling = instruments.pipeline_profiled(iteration)
        step_start = time.perf_counter()
        with (
            instruments.around_step(iteration, measuring=iteration == first and lg.log_memory) as activations,
            self.fault.at(iteration, self.model.module),
        ):
            result = train_step(
                self.model,
                self.optimizer,
                batches,
                self.precision,
                self.config.optimizer.clip_grad,
                self.per_token_loss,
                self.step_options,
            )
            if result.nonfinite:  # the same step again, watched (inside the injected fault, if any)
                result.nonfinite_where = self._first_nonfinite(batches)
        if iteration == first:  # its speed is the step's own, without what came before or the report
            window.restart(at=step_start)
            with window.paused():
                instruments.after_first_step(activations, step_start)
        if profiling:
            with window.paused():
                instruments.after_pipeline_profiled(iteration)
        self._count(iteration, plan, result, window)
        self.writer.advance()
        instruments.after_step(iteration, window)
        return lr, result

    def _count(self, iteration: int, plan: BatchPlan, result: StepResult, window: StepWindow) -> None:
        """The step's samples in the counters and the window; a skipped step said."""
        state = self.state
        state.iteration = iteration
        state.consumed_samples += plan.global_batch_size
        if not (result.skipped or result.nonfinite or result.withheld):  # (as Megatron-LM: moves with applied steps)
            state.lr_samples += plan.global_batch_size
        if not result.nonfinite:  # (a non-finite loss would hide the interval's others)
            window.add(result, plan.global_batch_size)
        if result.skipped:
            state.skipped_iterations += 1
            self.writer.info(
                f"step {iteration}: fp16 gradients overflowed; step skipped, loss scale now "
                f"{self.precision.scaler.scale:g} ({state.skipped_iterations} skipped so far)"
            )

    def _plan_at(self, consumed_samples: int) -> BatchPlan:
        """The batch plan of the step that starts after `consumed_samples` samples: the full global
        batch, or the batch of --rampup-batch-size or --step-batch-size-schedule (more micro-batches as it grows; the
        pipeline schedule is rebuilt for their count)."""
        if self.ramp is None:
            return self.plan
        plan = self.layout.batches(self.plan.dp_rank, self.ramp.batch_at(consumed_samples))
        pipeline = self.model.pipeline
        if pipeline is not None and pipeline.schedule.microbatches != plan.num_micro_batches:
            old = pipeline.schedule
            pipeline.schedule = build_schedule(old.name, old.pp, plan.num_micro_batches, old.chunks)
        return plan

    def _first_nonfinite(self, batches: list[Batch]) -> str:
        """Run the step's forward and backward again with every module watched; which module's
        output or output gradient went non-finite first (gradients are zeroed before the next step)."""
        weights, _ = self.model.loss_weights(batches, self.per_token_loss)
        self.model.zero_grad()
        with watching(self.model.module) as found:
            self.model.forward_backward(batches, weights=weights, backward=self.precision.backward)
        self.model.zero_grad()
        return first_report(found, self.topology.pp_rank, self.ctx.rank)

    def _judge_loss(self, loss: torch.Tensor) -> bool:
        """--loss-spike-zscore: the step's loss averaged over data-parallel ranks, judged before the optimizer steps."""
        return self.recovery.judge_loss(self.state.iteration + 1, self.logger.dp_mean(loss))

    def _step_extra(self, tasks: dict[str, float] | None, spike: Spike | None) -> dict[str, float] | None:
        """What a step adds to its record beyond the usual (which makes it a logged step): --eval-tasks' metrics,
        --log-layer-stats' statistics (collective), the z-score of a loss spike; None when nothing."""
        extra = dict(tasks) if tasks is not None else None
        stats = self.step_options.layer_stats
        if stats is not None:
            extra = {**(extra or {}), **stats.finish()}
            self.step_options.layer_stats = None
        if spike is not None:
            extra = {**(extra or {}), "loss_spike": spike.zscore}
        return extra

    def _evaluate(self, iteration: int, last: bool, window: StepWindow) -> None:
        t = self.config.training
        if t.eval_iters != 0 and self.data.valid is not None and (iteration % t.eval_interval == 0 or last):
            with window.paused():
                collect_around_eval(t)
                loss, tasks = self.evaluate(-(-iteration // t.eval_interval) - 1)
                collect_around_eval(t)
                if t.empty_unused_memory_level >= 1:
                    release_unused_memory(self.ctx.device)
                self.state.val_losses.append(loss)
                self.writer.log_eval(iteration, loss, tasks if len(tasks) > 1 or self.config.data.sft else None)

    def _evaluate_tasks(self, iteration: int, last: bool, window: StepWindow) -> dict[str, float] | None:
        """--eval-tasks every --eval-interval steps and at the end: the harness' metrics as the step's record
        keys (`tasks/<task>/<metric>`; {} on the ranks that do not log them); None when not due."""
        t = self.config.training
        if not self.config.inference.eval_tasks or not (iteration % t.eval_interval == 0 or last):
            return None
        if self.eval_tasks is None:
            from paratron.inference.tasks import TrainingTasks  # (start-up speed, docs/architecture.md: lm_eval)

            self.eval_tasks = TrainingTasks(self.config.inference)
        with window.paused():
            self._moved(iteration)
            moved = functools.partial(self._moved, iteration)  # (the watchdog hears every engine step)
            metrics = self.eval_tasks.evaluate(self.model, self.data.tokenizer, self.topology, moved)
            self._moved(iteration)
        return {f"{TASK_PREFIX}{key}": value for key, value in metrics.items()}

    def _save(self, iteration: int, final: bool, window: StepWindow) -> None:
        c = self.config.checkpoint
        if c.save and ((c.save_interval and iteration % c.save_interval == 0) or final):
            with window.paused():
                path = self.saver.save(Path(c.save), self.state)
                self._moved(iteration)
                self._log_progress(iteration)
                self.writer.info(f"{'writing' if c.async_save else 'saved'} checkpoint {path}")

    def _log_progress(self, iteration: int) -> None:
        """--log-progress: a line in progress.txt for the checkpoint just saved."""
        if self.progress is not None:
            tokens = self.state.consumed_samples * self.config.data.seq_length
            self.progress.saved(iteration, self.flops_per_token * tokens, tokens, self.config.checkpoint.async_save)

    def _moved(self, iteration: int) -> None:
        """Tell the watchdog the loop moves (a step, a save or an evaluation batch began or ended)."""
        if self.watchdog is not None:
            self.watchdog.progress(iteration)

    # ---------------------------------------------------------------- evaluation

    def evaluate(self, number: int) -> tuple[float, dict[str, dict[str, float]]]:
        """Per-token mean loss of the `number`-th evaluation of each validation task (one task, unless fine-tuning
        data names several files; which batches: `validation_batches`): the overall loss and {task: {"loss",
        "tokens"}}."""
        assert self.data.valid is not None
        tasks = self.data.valid_tasks or {"valid": self.data.valid}
        chosen = validation_batches(self.config, tasks, self.plan, self.documents, number, self.ctx.device)

        def moving(batches: Iterator[list[Batch]]) -> Iterator[list[Batch]]:
            for batch in batches:
                self._moved(self.state.iteration)  # (a long evaluation is progress, not a hang)
                yield batch

        losses, tokens = task_loss_sums(self.model, {n: moving(b) for n, b in chosen.items()}, self.ctx.device)
        reshard(self.model.module)  # (ZeRO-3: the forwards left the root's parameters gathered)
        results = {name: {"loss": s / max(n, 1), "tokens": n} for name, s, n in zip(tasks, losses, tokens)}
        return sum(losses) / max(sum(tokens), 1), results
