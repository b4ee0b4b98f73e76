"""The training loop: a short loop over named steps (train, log, evaluate, save, profile).

Everything it needs is built beforehand (`training/run.py`); this file only runs it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from paratron.checkpoint.io import (
    BackgroundSave,
    CheckpointContent,
    CheckpointInfo,
    begin_save,
    load_model_weights,
    load_training_state,
    read_checkpoint,
    weight_catalog,
    write_text_atomic,
)
from paratron.checkpoint.optimizer_state import load_optimizer
from paratron.config.layout import Layout
from paratron.config.samples import batch_ramp
from paratron.config.schema import Config
from paratron.data.build import DataBundle
from paratron.data.datasets import SampleSource
from paratron.data.loader import BatchPlan, DocumentLayout, micro_batches
from paratron.distributed import comm, rng
from paratron.distributed.init import DistributedContext, memory_now, peak_memory_bytes, release_unused_memory
from paratron.distributed.launch import restart_count
from paratron.distributed.topology import Axis, Topology
from paratron.distributed.watchdog import Watchdog
from paratron.errors import CheckpointError, NonFiniteStop
from paratron.model.batch import Batch
from paratron.optim.lr_schedule import LRSchedule
from paratron.optim.mixed_precision import Precision, build_loss_scaler
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.data.fully_sharded import reshard
from paratron.parallel.model import ParallelModel
from paratron.parallel.pipeline.profile import save_profile
from paratron.parallel.pipeline.schedules import build_schedule, theoretical_bubble
from paratron.training.evaluate import task_loss_sums
from paratron.training.exit import ExitConditions
from paratron.training.expert_load import ExpertStats, reduce_expert_stats
from paratron.training.faults import AttemptFault
from paratron.training.flops import bounded_mfu
from paratron.training.memory import SavedActivations, format_memory, gather_memory, rank_memory
from paratron.training.metrics import MetricsWriter, ProgressLog, tensorboard_folder
from paratron.training.nonfinite import first_report, watching
from paratron.training.plot import plot_expert_load
from paratron.training.profiling import StepProfiler, StepTimers, collect_after_step, collect_around_eval
from paratron.training.step import StepOptions, StepResult, params_norm, train_step


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    lr_samples: int = 0
    """Samples the applied steps trained (a skipped step's count not): where the learning-rate
    schedule stands (Megatron-LM's `OptimizerParamScheduler.num_steps`)."""
    losses: list[float] = field(default_factory=list)
    """Logged train loss of each log interval."""
    val_losses: list[float] = field(default_factory=list)


@dataclass
class _Window:
    """The steps since the last log line: their summed loss and when they started. Time spent
    evaluating, saving or writing profiles is not part of the steps' speed: `start` moves past it."""

    loss: torch.Tensor
    trained_tokens: torch.Tensor
    steps: int = 0
    samples: int = 0
    """Samples the steps consumed (their global batches, which a --rampup-batch-size ramp grows)."""
    start: float = field(default_factory=time.perf_counter)
    experts: ExpertStats | None = None

    def add(self, result: StepResult, samples: int) -> None:
        self.loss += result.loss
        self.trained_tokens += result.trained_tokens
        self.steps += 1
        self.samples += samples
        if result.experts is not None:
            if self.experts is None:
                self.experts = result.experts
            else:
                self.experts.add(result.experts)

    def restart(self) -> None:
        self.loss.zero_()
        self.trained_tokens.zero_()
        self.steps = 0
        self.samples = 0
        self.experts = None
        self.start = time.perf_counter()


@dataclass
class Trainer:
    config: Config
    ctx: DistributedContext
    topology: Topology
    layout: Layout
    model: ParallelModel
    optimizer: TrainingOptimizer
    data: DataBundle
    writer: MetricsWriter
    flops_per_token: float
    peak_flops: float
    state: TrainState = field(default_factory=TrainState)
    watchdog: Watchdog | None = None
    """Told of every step and save; a loop that stops moving is reported (distributed/watchdog.py)."""
    progress: ProgressLog | None = None
    """--log-progress: told of every saved checkpoint."""
    _peak_raised: bool = False
    """A step went faster than the peak used for MFU, and the peak was raised (said once)."""
    _background: BackgroundSave | None = None

    def __post_init__(self) -> None:
        t, layout = self.config.training, self.layout
        self.plan = BatchPlan(layout.global_batch_size, layout.micro_batch_size, layout.dp, self.topology.dp_rank)
        self.schedule = LRSchedule.of(self.config, layout.global_batch_size)
        self.ramp = batch_ramp(t.rampup(), layout.global_batch_size)  # (--rampup-batch-size: None without)
        self.precision = Precision(t.precision, build_loss_scaler(t), self.ctx.device)
        d, tokenizer = self.config.data, self.data.tokenizer
        self.documents = DocumentLayout.of(d, self.config.model, tokenizer.eod_id if tokenizer is not None else None)
        self.per_token_loss = t.calculate_per_token_loss if t.calculate_per_token_loss is not None else d.sft
        self.expert_load: list[tuple[int, np.ndarray]] = []  # (step, token shares [MoE layers, experts])
        self.fault = AttemptFault(t.fault_inject, restart_count(), self.ctx.rank)
        self.skip_batch_at: set[int] = set()  # iterations whose batch a rollback leaves out

    @property
    def global_batch_size(self) -> int:
        return self.layout.global_batch_size

    def fit(self, stop_after: int | None = None) -> TrainState:
        """Train from the state's iteration to --train-iters (or only to `stop_after`; the
        learning-rate schedule still spans --train-iters)."""
        end = stop_after or self.config.training.train_iters
        first = self.state.iteration + 1
        window = _Window(torch.zeros((), device=self.ctx.device), torch.zeros((), device=self.ctx.device))
        with ExitConditions(self.config.training, self.ctx.device) as exits:
            iteration = first - 1
            while iteration < end:
                iteration += 1
                self._moved(iteration)
                lr, result = self._train(iteration, first, window)
                self._moved(iteration)
                if result.nonfinite and self._after_nonfinite(iteration, result.nonfinite_where, window):
                    iteration = self.state.iteration  # rolled back: go on after the checkpoint
                    continue
                stopping = exits.reason(iteration)
                last = iteration == end
                if iteration % self.config.logging.log_interval == 0 or last or stopping:
                    self._log(iteration, lr, result, window)
                self._evaluate(iteration, last, window)
                self._save(iteration, last or bool(stopping), window)
                if stopping and not last:
                    self.writer.info(
                        f"stopping after step {iteration} of {self.config.training.train_iters}: {stopping}"
                    )
                    break
        self.finish_save()
        self.model.wait_param_gather()
        if self.expert_load and self.ctx.is_main:
            self.writer.info(f"expert load: {plot_expert_load(self.expert_load, Path(self.config.logging.run_dir))}")
        return self.state

    # ---------------------------------------------------------------- the named steps

    def _train(self, iteration: int, first: int, window: _Window) -> tuple[float, StepResult]:
        """One optimizer step (measuring memory on the first with --log-memory, profiling the
        pipeline on the last with --profile-pipeline)."""
        t, lg, state = self.config.training, self.config.logging, self.state
        lr = self.schedule.apply(self.optimizer.param_groups, state.lr_samples)
        if iteration in self.skip_batch_at:  # rolled back past it: its batch made the gradients non-finite
            self.skip_batch_at.discard(iteration)
            state.consumed_samples += self._plan_at(state.consumed_samples).global_batch_size
        plan = self._plan_at(state.consumed_samples)
        with self._timers.time("batch-generator"):
            batches = micro_batches(self.data.train, plan, state.consumed_samples, self.ctx.device, self.documents)
        pipeline = self.model.pipeline
        profiling = lg.profile_pipeline and pipeline is not None and iteration == t.train_iters
        if profiling:
            dist.barrier()  # the ranks' clocks start together
            pipeline.record = True
        measuring = iteration == first and lg.log_memory
        self._profiler.begin(iteration)
        step_start = time.perf_counter()
        with (
            SavedActivations(self.model.module) if measuring else contextlib.nullcontext() as activations,
            self.fault.at(iteration, self.model.module),
        ):
            result = train_step(
                self.model,
                self.optimizer,
                batches,
                self.precision,
                self.config.optimizer.clip_grad,
                self.per_token_loss,
                self._step_options,
            )
            if result.nonfinite:  # the same step again, watched (inside the injected fault, if any)
                result.nonfinite_where = self._first_nonfinite(batches)
        if iteration == first:  # its speed is the step's own, without what came before or the report
            reporting = time.perf_counter()
            self._report_memory(activations)
            window.restart()
            window.start = step_start + (time.perf_counter() - reporting)
        if profiling:
            pipeline.record = False
            saving = time.perf_counter()
            self._save_pipeline_profile(iteration)
            window.start += time.perf_counter() - saving  # not part of the steps' speed
        state.iteration = iteration
        state.consumed_samples += plan.global_batch_size
        if not (result.skipped or result.nonfinite):  # (as Megatron-LM: the schedule moves with applied steps)
            state.lr_samples += plan.global_batch_size
        if not result.nonfinite:  # (a non-finite loss would hide the interval's others)
            window.add(result, plan.global_batch_size)
        if result.skipped:
            state.skipped_iterations += 1
            self.writer.info(
                f"step {iteration}: fp16 gradients overflowed; step skipped, loss scale now "
                f"{self.precision.scaler.scale:g} ({state.skipped_iterations} skipped so far)"
            )
        self.writer.advance()
        self._after_step(iteration, window)
        return lr, result

    def _plan_at(self, consumed_samples: int) -> BatchPlan:
        """The batch plan of the step that starts after `consumed_samples` samples: the full global
        batch, or the ramp's batch with --rampup-batch-size (more micro-batches as it grows; the
        pipeline schedule is rebuilt for their count)."""
        if self.ramp is None:
            return self.plan
        base = self.plan
        plan = BatchPlan(self.ramp.batch_at(consumed_samples), base.micro_batch_size, base.dp_size, base.dp_rank)
        pipeline = self.model.pipeline
        if pipeline is not None and pipeline.schedule.microbatches != plan.num_micro_batches:
            old = pipeline.schedule
            pipeline.schedule = build_schedule(old.name, old.pp, plan.num_micro_batches, old.chunks)
        return plan

    def _resume_schedule(self, checkpoint: CheckpointInfo) -> None:
        """The learning-rate schedule on resume, as Megatron-LM's scheduler loads its state: the
        checkpoint's peak, floor, warmup, decay length and style with
        --use-checkpoint-opt-param-scheduler, the flags' with --override-opt-param-scheduler, and
        otherwise the flags', with a warning where they differ from the checkpoint's (Megatron-LM
        refuses to go on there, so no script that runs in Megatron-LM trains differently here)."""
        s = self.config.lr_schedule
        if s.override_opt_param_scheduler:
            return
        saved_config = checkpoint.config
        saved_batch = saved_config.training.global_batch_size or self.global_batch_size
        saved = LRSchedule.of(saved_config, saved_batch).settings()
        if s.use_checkpoint_opt_param_scheduler:
            self.schedule = self.schedule.with_settings(saved)
            return
        ours = self.schedule.settings()
        changed = [name for name in ours if ours[name] != saved[name]]
        if changed:
            differences = ", ".join(f"{name} {ours[name]!r} (checkpoint: {saved[name]!r})" for name in changed)
            self.writer.info(
                f"warning: the learning-rate schedule differs from the checkpoint's: {differences}; going on with "
                "the flags' (--override-opt-param-scheduler says so and silences this, "
                "--use-checkpoint-opt-param-scheduler takes the checkpoint's; Megatron-LM stops here)"
            )

    def _first_nonfinite(self, batches: list[Batch]) -> str:
        """Run the step's forward and backward again with every module watched; which module's
        output or output gradient went non-finite first (gradients are zeroed before the next step)."""
        weights, _ = self.model.loss_weights(batches, self.per_token_loss)
        self.model.zero_grad()
        with watching(self.model.module) as found:
            self.model.forward_backward(batches, self.precision.backward, weights)
        self.model.zero_grad()
        return first_report(found, self.topology.pp_rank, self.ctx.rank)

    def _after_nonfinite(self, iteration: int, where: str, window: _Window) -> bool:
        """--on-nan after a step whose gradients were not finite (it was not applied): say where,
        then stop, skip the batch, or reload the newest checkpoint (True: rolled back)."""
        how = self.config.training.on_nan
        what = f"step {iteration}: the gradients are not finite; first non-finite: {where}"
        save = self.config.checkpoint.save
        if how == "skip":
            self.state.skipped_iterations += 1
            self.writer.info(f"{what}; step skipped (--on-nan skip)")
            return False
        if how == "rollback" and save:
            self.finish_save()
            try:
                checkpoint = read_checkpoint(Path(save))
            except CheckpointError:
                checkpoint = None
            if checkpoint is not None:
                self.writer.info(f"{what}; back to {checkpoint.path}, without this step's batch (--on-nan rollback)")
                self.resume_from(checkpoint)
                self.skip_batch_at.add(iteration)
                self.writer.rewind(checkpoint.iteration)
                window.restart()
                return True
            what += "; no checkpoint in --save to roll back to"
        elif how == "rollback":
            what += "; --on-nan rollback needs --save"
        raise NonFiniteStop(f"{what}; stopped (--on-nan {how})")

    def resume_from(self, checkpoint: CheckpointInfo, weights: bool = True, optimizer_state: bool = True) -> None:
        """Weights, counters, random generators, loss scaler and optimizer state (each unless told
        not to) from `checkpoint`, at any layout: on resume, and on --on-nan rollback."""
        if weights:
            load_model_weights(checkpoint, self.model.module, whole=self.topology.size(Axis.PP) == 1)
        self.state.iteration, self.state.consumed_samples = checkpoint.iteration, checkpoint.consumed_samples
        state_of_rank, own = load_training_state(checkpoint, self.topology)
        self.restore_rank_state(state_of_rank, own)
        if "lr_schedule_samples" not in state_of_rank:  # (saved before the schedule counted samples)
            skipped = self.state.skipped_iterations * self.global_batch_size
            self.state.lr_samples = max(0, checkpoint.consumed_samples - skipped)
        if optimizer_state:  # pieces under single-device names: any layout
            with weight_catalog(checkpoint) as saved_weights:  # (masters, when the checkpoint kept none)
                load_optimizer(checkpoint.path, self.optimizer, self.model.module, saved_weights)
            self._resume_schedule(checkpoint)
        else:  # (Megatron-LM loads the scheduler with the optimizer: without it the schedule restarts)
            self.state.lr_samples = 0

    def _log(self, iteration: int, lr: float, result: StepResult, window: _Window) -> None:
        if not window.steps:  # only a non-finite step since the last line, and it said so
            return
        loss = self._dp_mean(window.loss / window.steps)
        seconds = time.perf_counter() - window.start
        tokens_per_s = window.samples * self.config.data.seq_length / seconds
        trained = window.trained_tokens.clone()
        comm.all_reduce(trained, self.topology.group(Axis.DP))
        flops_per_device = self.flops_per_token * tokens_per_s / self.ctx.world_size
        record = {
            "step": iteration,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(result.grad_norm) if result.grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "trained_tokens_per_s": float(trained.item()) / seconds,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": self._mfu(iteration, flops_per_device),
            "mem_gb": peak_memory_bytes(self.ctx.device) / 1e9,
            "consumed_samples": self.state.consumed_samples,
            "skipped_iterations": self.state.skipped_iterations,
            "iteration-time": seconds / window.steps,
        }
        record.update(self._megatron_metrics(result, window, flops_per_device))
        if self.precision.scaler is not None:
            record["loss_scale"] = self.precision.scaler.scale
        if window.experts is not None:
            record.update(reduce_expert_stats(self.model, window.experts))
            if self.config.logging.log_expert_load:
                tokens = np.asarray(record["moe_tokens_per_expert"], dtype=np.float64)
                self.expert_load.append((iteration, tokens / np.maximum(tokens.sum(axis=1, keepdims=True), 1)))
        self.state.losses.append(loss)
        self.writer.log_step(record)
        if not math.isfinite(loss):
            self.writer.info(f"step {iteration}: the loss is {loss}; see docs/troubleshooting.md (NaN)")
        window.restart()

    def _megatron_metrics(self, result: StepResult, window: _Window, flops_per_device: float) -> dict[str, Any]:
        """What the Megatron-LM logging flags add to a logged step's record (collectives: every rank
        takes part)."""
        lg, record = self.config.logging, {}
        if lg.log_params_norm:
            record["params_norm"] = float(params_norm(self.optimizer))
        if lg.log_num_zeros_in_grad:
            zeros = result.num_zeros_in_grad
            record["num_zeros_in_grad"] = int(zeros.item()) if zeros is not None else None
        if lg.log_throughput:
            record["throughput"] = flops_per_device / 1e12
        if lg.log_batch_size_to_tensorboard:
            record["batch_size"] = window.samples // window.steps
        if lg.log_world_size_to_tensorboard:
            record["world_size"] = self.ctx.world_size
        if lg.log_memory_to_tensorboard:
            record.update(memory_now(self.ctx.device))
        record.update(self._timers.report(window.steps, lg.timing_log_option))
        self._timers.reset()
        return record

    def _mfu(self, iteration: int, flops_per_device: float) -> float:
        """Model FLOPs utilization, at most 1: a step faster than the peak raises the peak (once said)."""
        mfu, peak, raised = bounded_mfu(flops_per_device, self.peak_flops)
        if raised:
            if not self._peak_raised:
                self.writer.info(
                    f"warning: step {iteration} ran at {flops_per_device / 1e12:.3f} TFLOP/s/device, above the peak "
                    f"of {self.peak_flops / 1e12:.3f} used for MFU (a matmul probe slowed by other work on the "
                    "machine, or a low --peak-tflops); MFU is measured against the fastest step from now on"
                )
            self._peak_raised = True
            self.peak_flops = peak
        return mfu

    @functools.cached_property
    def _timers(self) -> StepTimers:
        """--timing-log-level's timers of this rank."""
        return StepTimers(self.config.logging.timing_log_level, self.ctx.device)

    @functools.cached_property
    def _profiler(self) -> StepProfiler:
        lg = self.config.logging
        folder = tensorboard_folder(Path(lg.run_dir), lg)
        return StepProfiler(lg, self.ctx.rank, self.ctx.device, folder)

    @functools.cached_property
    def _step_options(self) -> StepOptions:
        t = self.config.training
        return StepOptions(
            check_nonfinite=t.check_for_nan_in_loss_and_grad,
            count_zeros=self.config.logging.log_num_zeros_in_grad,
            timers=self._timers,
            empty_unused_memory_level=t.empty_unused_memory_level,
            device=self.ctx.device,
        )

    def _after_step(self, iteration: int, window: _Window) -> None:
        """--profile's trace after its last step (not part of the steps' speed), --manual-gc."""
        writing = time.perf_counter()
        trace = self._profiler.finish_step(iteration)
        if trace is not None:
            print(f"rank {self.ctx.rank}: profile of steps {self._profiler.start}-{self._profiler.end - 1}: {trace}")
            window.start += time.perf_counter() - writing
        collect_after_step(self.config.training, iteration)

    def finish_profile(self) -> None:
        """Write the --profile trace of a run that stopped before --profile-step-end."""
        trace = self._profiler.close()
        if trace is not None:
            print(f"rank {self.ctx.rank}: profile (cut short by the end of training): {trace}")

    def _evaluate(self, iteration: int, last: bool, window: _Window) -> None:
        t = self.config.training
        if t.eval_iters > 0 and self.data.valid is not None and (iteration % t.eval_interval == 0 or last):
            collect_around_eval(t)
            loss, tasks = self.evaluate(-(-iteration // t.eval_interval) - 1)
            collect_around_eval(t)
            if t.empty_unused_memory_level >= 1:
                release_unused_memory(self.ctx.device)
            self.state.val_losses.append(loss)
            self.writer.log_eval(iteration, loss, tasks if len(tasks) > 1 or self.config.data.sft else None)
            window.start = time.perf_counter()

    def _save(self, iteration: int, final: bool, window: _Window) -> None:
        c = self.config.checkpoint
        if c.save and ((c.save_interval and iteration % c.save_interval == 0) or final):
            path = self.save(Path(c.save))
            self._moved(iteration)
            self._log_progress(iteration)
            self.writer.info(f"{'writing' if c.async_save else 'saved'} checkpoint {path}")
            window.start = time.perf_counter()

    def _log_progress(self, iteration: int) -> None:
        """--log-progress: a line in progress.txt for the checkpoint just saved."""
        if self.progress is not None:
            tokens = self.state.consumed_samples * self.config.data.seq_length
            self.progress.saved(iteration, self.flops_per_token * tokens, tokens, self.config.checkpoint.async_save)

    def _moved(self, iteration: int) -> None:
        """Tell the watchdog the loop moves (a step, a save or an evaluation batch began or ended)."""
        if self.watchdog is not None:
            self.watchdog.progress(iteration)

    # ---------------------------------------------------------------- their parts

    def _dp_mean(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over data-parallel ranks (a host sync). Under pipeline
        parallelism the last stage holds the value and the others zero: summed over the stages."""
        pp, dp = self.topology.group(Axis.PP), self.topology.group(Axis.DP)
        if pp.size > 1:
            value = value.clone()
            dist.all_reduce(value, group=pp.process_group)
        if dp.size > 1:
            value = value.clone()
            dist.all_reduce(value, group=dp.process_group)
            value /= dp.size
        return float(value.item())

    def _report_memory(self, activations: SavedActivations | None) -> None:
        """After the first step (when the optimizer state exists): rank 0's training state in one
        line; with --log-memory every rank's, with the activations saved for backward, in a table
        and in memory.json."""
        report = rank_memory(self.model, self.optimizer, activations, self.ctx.device)
        mib = {k: (v or 0) / 2**20 for k, v in report.items()}
        self.writer.info(
            f"memory of rank 0 after the first step: parameters {mib['parameters']:,.1f} MiB, gradients "
            f"{mib['gradients']:,.1f}, master weights {mib['master']:,.1f}, optimizer state "
            f"{mib['optimizer_state']:,.1f}"
            + (f", activations (peak) {mib['activations_peak']:,.1f}" if activations is not None else "")
        )
        if activations is None:
            return
        report["coordinates"] = f"tp{self.topology.tp_rank} pp{self.topology.pp_rank} dp{self.topology.dp_rank}"
        reports = gather_memory(report)
        if self.ctx.is_main:
            path = Path(self.config.logging.run_dir) / "memory.json"
            write_text_atomic(path, json.dumps({"unit": "bytes", "ranks": reports}, indent=1) + "\n")
            self.writer.info("memory per rank after the first step (MiB; activations: peak bytes saved for backward):")
            for line in format_memory(reports):
                self.writer.info("  " + line)
            self.writer.info(f"memory report: {path}")

    def _save_pipeline_profile(self, iteration: int) -> None:
        if self.topology.dp_rank != 0 or self.topology.tp_rank != 0:
            return
        pipeline = self.model.pipeline
        assert pipeline is not None
        schedule = pipeline.schedule
        title = (
            f"step {iteration}: {schedule.name}, {schedule.pp} stages x {schedule.chunks} chunk(s), "
            f"{schedule.microbatches} micro-batches (measured)"
        )
        result = save_profile(
            pipeline.spans,
            Path(self.config.logging.run_dir),
            self.topology.pp_rank,
            self.topology.group(Axis.PP),
            self.ctx.is_main,
            title,
        )
        if result is not None:
            bubble, files = result
            theory = theoretical_bubble(schedule.name, schedule.pp, schedule.microbatches, schedule.chunks)
            self.writer.info(
                f"pipeline profile of step {iteration}: bubble {bubble:.1%} of the step measured "
                f"({theory:.1%} in theory); rank 0 held at most {pipeline.peak_live} micro-batch "
                f"activations at once; {', '.join(str(f) for f in files)}"
            )

    def evaluate(self, number: int) -> tuple[float, dict[str, dict[str, float]]]:
        """Per-token mean loss over the `number`-th run of eval_iters global batches of each
        validation task (one task, unless fine-tuning data names several files): the overall loss
        and {task: {"loss", "tokens"}}.

        As in Megatron-LM, each evaluation reads the next batches (the evaluation at step i is
        number ceil(i / eval_interval) - 1), so the order is a pure function of the step."""
        assert self.data.valid is not None
        tasks = self.data.valid_tasks or {"valid": self.data.valid}
        iters, device = self.config.training.eval_iters, self.ctx.device
        first = number * iters * self.global_batch_size

        def batches(source: SampleSource) -> Iterator[list[Batch]]:
            for i in range(iters):
                self._moved(self.state.iteration)  # (a long evaluation is progress, not a hang)
                yield micro_batches(source, self.plan, first + i * self.global_batch_size, device, self.documents)

        losses, tokens = task_loss_sums(self.model, {name: batches(source) for name, source in tasks.items()}, device)
        reshard(self.model.module)  # (ZeRO-3: the forwards left the root's parameters gathered)
        results = {name: {"loss": s / max(n, 1), "tokens": n} for name, s, n in zip(tasks, losses, tokens)}
        return sum(losses) / max(sum(tokens), 1), results

    def save(self, root: Path) -> Path:
        """Save a checkpoint; with --async-save start writing it and return (see `finish_save`)."""
        self.finish_save()
        self.model.wait_param_gather()
        content = CheckpointContent(
            self.state.iteration,
            self.state.consumed_samples,
            self.config,
            self.model.module,
            self.optimizer,
            self.data.tokenizer,
            self.rank_state(),
        )
        pending = begin_save(root, content, self.topology, snapshot=self.config.checkpoint.async_save)
        if not self.config.checkpoint.async_save:
            pending.write()
            return pending.publish()
        self._background = BackgroundSave(pending)
        return pending.final

    def finish_save(self) -> None:
        """Publish the checkpoint being written in the background, if any (every rank)."""
        if self._background is not None:
            path = self._background.finish()
            self._background = None
            self.writer.info(f"published checkpoint {path} (written in the background)")

    def rank_state(self) -> dict[str, Any]:
        """What this rank needs beyond the weights and the optimizer state to resume exactly."""
        state: dict[str, Any] = {
            "rng": rng.capture(self.ctx.device),
            "skipped_iterations": self.state.skipped_iterations,
            "lr_schedule_samples": self.state.lr_samples,
        }
        if self.precision.scaler is not None:
            state["loss_scaler"] = self.precision.scaler.state_dict()
        if self.model.rng_states is not None:
            state["tensor_parallel_rng"] = dict(self.model.rng_states.states)
        return state

    def restore_rank_state(self, state: dict[str, Any], own: bool = True) -> None:
        """Counters and loss scaler from `state`; the random generators too when it is this rank's
        `own` (saved at the same layout; elsewhere they start from the seed) and --no-load-rng is not set."""
        if own and not self.config.checkpoint.no_load_rng:
            rng.restore(state["rng"], self.ctx.device)
            if self.model.rng_states is not None and "tensor_parallel_rng" in state:
                self.model.rng_states.states.update(state["tensor_parallel_rng"])
        self.state.skipped_iterations = int(state.get("skipped_iterations", 0))
        self.state.lr_samples = int(state.get("lr_schedule_samples", 0))
        if self.precision.scaler is not None and "loss_scaler" in state:
            self.precision.scaler.load_state_dict(state["loss_scaler"])
