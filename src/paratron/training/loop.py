"""The training loop: a short loop over named steps (train, log, evaluate, save, profile).

Everything it needs is built beforehand (`training/run.py`); this file only runs it.
"""

from __future__ import annotations

import contextlib
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
from paratron.config.schema import Config
from paratron.data.build import DataBundle
from paratron.data.datasets import SampleSource
from paratron.data.loader import BatchPlan, DocumentLayout, micro_batches
from paratron.distributed import comm, rng
from paratron.distributed.init import DistributedContext, peak_memory_bytes
from paratron.distributed.launch import restart_count
from paratron.distributed.topology import Axis, Topology
from paratron.distributed.watchdog import Watchdog
from paratron.errors import CheckpointError, NonFiniteStop
from paratron.model.batch import Batch
from paratron.optim.build import set_learning_rate
from paratron.optim.lr_schedule import learning_rate
from paratron.optim.mixed_precision import Precision, build_loss_scaler
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import ParallelModel
from paratron.parallel.pipeline.profile import save_profile
from paratron.parallel.pipeline.schedules import theoretical_bubble
from paratron.training.evaluate import task_loss_sums
from paratron.training.exit import ExitConditions
from paratron.training.expert_load import ExpertStats, reduce_expert_stats
from paratron.training.faults import AttemptFault
from paratron.training.memory import SavedActivations, format_memory, gather_memory, rank_memory
from paratron.training.metrics import MetricsWriter
from paratron.training.nonfinite import first_report, watching
from paratron.training.plot import plot_expert_load
from paratron.training.step import StepResult, train_step


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
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
    start: float = field(default_factory=time.perf_counter)
    experts: ExpertStats | None = None

    def add(self, result: StepResult) -> None:
        self.loss += result.loss
        self.trained_tokens += result.trained_tokens
        self.steps += 1
        if result.experts is not None:
            if self.experts is None:
                self.experts = result.experts
            else:
                self.experts.add(result.experts)

    def restart(self) -> None:
        self.loss.zero_()
        self.trained_tokens.zero_()
        self.steps = 0
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
    _background: BackgroundSave | None = None

    def __post_init__(self) -> None:
        t, layout = self.config.training, self.layout
        self.plan = BatchPlan(layout.global_batch_size, layout.micro_batch_size, layout.dp, self.topology.dp_rank)
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
        lr = learning_rate(iteration, self.config.optimizer.lr, self.config.lr_schedule, t.train_iters)
        set_learning_rate(self.optimizer, lr)
        if iteration in self.skip_batch_at:  # rolled back past it: its batch made the gradients non-finite
            self.skip_batch_at.discard(iteration)
            state.consumed_samples += self.global_batch_size
        batches = micro_batches(self.data.train, self.plan, state.consumed_samples, self.ctx.device, self.documents)
        pipeline = self.model.pipeline
        profiling = lg.profile_pipeline and pipeline is not None and iteration == t.train_iters
        if profiling:
            dist.barrier()  # the ranks' clocks start together
            pipeline.record = True
        measuring = iteration == first and lg.log_memory
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
        state.consumed_samples += self.global_batch_size
        if not result.nonfinite:  # (a non-finite loss would hide the interval's others)
            window.add(result)
        if result.skipped:
            state.skipped_iterations += 1
            self.writer.info(
                f"step {iteration}: fp16 gradients overflowed; step skipped, loss scale now "
                f"{self.precision.scaler.scale:g} ({state.skipped_iterations} skipped so far)"
            )
        self.writer.advance()
        return lr, result

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
        if optimizer_state:  # pieces under single-device names: any layout
            with weight_catalog(checkpoint) as saved_weights:  # (masters, when the checkpoint kept none)
                load_optimizer(checkpoint.path, self.optimizer, self.model.module, saved_weights)

    def _log(self, iteration: int, lr: float, result: StepResult, window: _Window) -> None:
        if not window.steps:  # only a non-finite step since the last line, and it said so
            return
        loss = self._dp_mean(window.loss / window.steps)
        seconds = time.perf_counter() - window.start
        tokens_per_s = self.global_batch_size * self.config.data.seq_length * window.steps / seconds
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
            "mfu": flops_per_device / self.peak_flops,
            "mem_gb": peak_memory_bytes(self.ctx.device) / 1e9,
            "consumed_samples": self.state.consumed_samples,
            "skipped_iterations": self.state.skipped_iterations,
        }
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

    def _evaluate(self, iteration: int, last: bool, window: _Window) -> None:
        t = self.config.training
        if t.eval_iters > 0 and self.data.valid is not None and (iteration % t.eval_interval == 0 or last):
            loss, tasks = self.evaluate(-(-iteration // t.eval_interval) - 1)
            self.state.val_losses.append(loss)
            self.writer.log_eval(iteration, loss, tasks if len(tasks) > 1 or self.config.data.sft else None)
            window.start = time.perf_counter()

    def _save(self, iteration: int, final: bool, window: _Window) -> None:
        c = self.config.checkpoint
        if c.save and ((c.save_interval and iteration % c.save_interval == 0) or final):
            path = self.save(Path(c.save))
            self._moved(iteration)
            self.writer.info(f"{'writing' if c.async_save else 'saved'} checkpoint {path}")
            window.start = time.perf_counter()

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
        }
        if self.precision.scaler is not None:
            state["loss_scaler"] = self.precision.scaler.state_dict()
        if self.model.rng_states is not None:
            state["tensor_parallel_rng"] = dict(self.model.rng_states.states)
        return state

    def restore_rank_state(self, state: dict[str, Any], own: bool = True) -> None:
        """Counters and loss scaler from `state`; the random generators too when it is this rank's
        `own` (saved at the same layout; elsewhere they start from the seed)."""
        if own:
            rng.restore(state["rng"], self.ctx.device)
            if self.model.rng_states is not None and "tensor_parallel_rng" in state:
                self.model.rng_states.states.update(state["tensor_parallel_rng"])
        self.state.skipped_iterations = int(state.get("skipped_iterations", 0))
        if self.precision.scaler is not None and "loss_scaler" in state:
            self.precision.scaler.load_state_dict(state["loss_scaler"])
