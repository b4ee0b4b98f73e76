"""A logged step's record: the steps since the last log line (`StepWindow`, whose clock pauses for
what is not training), and what `StepLogger` makes of them: loss, speed, MFU, memory, Megatron-LM's
logging metrics and the experts' load, handed to the `MetricsWriter`."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from paratron.config.schema import Config
from paratron.debugging.stragglers import StragglerDetector
from paratron.distributed import comm
from paratron.distributed.init import DistributedContext, memory_now, peak_memory_bytes
from paratron.distributed.topology import Axis, Topology
from paratron.optim.mixed_precision import Precision
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import ParallelModel
from paratron.training.expert_load import ExpertStats, reduce_expert_stats
from paratron.training.flops import bounded_mfu, vision_flops_per_image
from paratron.training.metrics import MetricsWriter
from paratron.training.profiling import StepTimers
from paratron.training.resume import TrainState
from paratron.training.step import StepResult, params_norm


class StepWindow:
    """The steps since the last log line: their summed loss and how long they took. Time spent
    evaluating, saving or writing reports is not part of the steps' speed: it runs `paused()`."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.trained_tokens = torch.zeros((), device=device)
        self.steps = 0
        self.samples = 0
        """Samples the steps consumed (their global batches, which a --rampup-batch-size ramp grows)."""
        self.images = 0
        """Images (tiles) in this rank's micro-batches of those steps."""
        self.experts: ExpertStats | None = None
        self.start = time.perf_counter()

    def add(self, result: StepResult, samples: int) -> None:
        self.loss += result.loss
        self.trained_tokens += result.trained_tokens
        self.steps += 1
        self.samples += samples
        self.images += result.images
        if result.experts is not None:
            if self.experts is None:
                self.experts = result.experts
            else:
                self.experts.add(result.experts)

    def restart(self, at: float | None = None) -> None:
        """Empty, its clock starting now (or at the `perf_counter` time `at`)."""
        self.loss.zero_()
        self.trained_tokens.zero_()
        self.steps = 0
        self.samples = 0
        self.images = 0
        self.experts = None
        self.start = time.perf_counter() if at is None else at

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The clock stands still within: what runs here is not part of the steps' speed."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began

    def seconds(self) -> float:
        return time.perf_counter() - self.start


class StepLogger:
    """Turns a window of steps into one record of metrics.jsonl (and the console, TensorBoard, wandb).
    Collective: every rank calls `log` at the same steps."""

    def __init__(
        self,
        config: Config,
        ctx: DistributedContext,
        topology: Topology,
        model: ParallelModel,
        optimizer: TrainingOptimizer,
        precision: Precision,
        writer: MetricsWriter,
        timers: StepTimers,
        flops_per_token: float,
        peak_flops: float,
    ) -> None:
        self.config, self.ctx, self.topology = config, ctx, topology
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.writer, self.timers = writer, timers
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.flops_per_image = vision_flops_per_image(config.model)
        self.peak_raised = False
        """A step went faster than the peak used for MFU, and the peak was raised (said once)."""
        self.expert_load: list[tuple[int, np.ndarray]] = []  # (step, token shares [MoE layers, experts])
        self.stragglers: StragglerDetector | None = None
        """--straggler-threshold's detector, whose figures each record carries (collective)."""

    def log(
        self,
        iteration: int,
        lr: float,
        result: StepResult,
        window: StepWindow,
        state: TrainState,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Log the window's steps (the last one's `result`) and empty the window; `extra`: more of the step's
        metrics (`train --eval-tasks`' `tasks/<task>/<metric>`), in the same record."""
        if not window.steps:  # only a non-finite step since the last line, and it said so
            for key, value in (extra or {}).items():
                self.writer.info(f"step {iteration}: {key} {value:.4f}")
            return
        loss = self.dp_mean(window.loss / window.steps)
        seconds = window.seconds()
        tokens_per_s = window.samples * self.config.data.seq_length / seconds
        trained = window.trained_tokens.clone()
        comm.all_reduce(trained, self.topology.group(Axis.DP))
        images_per_s = self.images_per_s(window, seconds)
        flops = self.flops_per_token * tokens_per_s + self.flops_per_image * images_per_s
        flops_per_device = flops / self.ctx.world_size
        record = {
            "step": iteration,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(result.grad_norm) if result.grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "trained_tokens_per_s": float(trained.item()) / seconds,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": self.mfu(iteration, flops_per_device),
            "mem_gb": peak_memory_bytes(self.ctx.device) / 1e9,
            "consumed_samples": state.consumed_samples,
            "skipped_iterations": state.skipped_iterations,
            "iteration-time": seconds / window.steps,
        }
        if self.flops_per_image:
            record["images_per_s"] = images_per_s
        record.update(self.megatron_metrics(result, window, flops_per_device))
        if self.stragglers is not None:
            record.update(self.stragglers.report(iteration, self.writer.info))
        if self.precision.scaler is not None:
            record["loss_scale"] = self.precision.scaler.scale
        if window.experts is not None:
            record.update(reduce_expert_stats(self.model, window.experts))
            if self.config.logging.log_expert_load:
                tokens = np.asarray(record["moe_tokens_per_expert"], dtype=np.float64)
                self.expert_load.append((iteration, tokens / np.maximum(tokens.sum(axis=1, keepdims=True), 1)))
        record.update(extra or {})
        state.losses.append(loss)
        self.writer.log_step(record)
        if not math.isfinite(loss):
            self.writer.info(f"step {iteration}: the loss is {loss}; see docs/troubleshooting.md (NaN)")
        window.restart()

    def images_per_s(self, window: StepWindow, seconds: float) -> float:
        """Images the window's steps ran through the vision encoder, over every data-parallel rank, per second."""
        if not self.flops_per_image:
            return 0.0
        count = torch.tensor(float(window.images), dtype=torch.float64, device=self.ctx.device)
        comm.all_reduce(count, self.topology.group(Axis.DP))
        return float(count.item()) / seconds

    def megatron_metrics(self, result: StepResult, window: StepWindow, flops_per_device: float) -> dict[str, Any]:
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
        record.update(self.timers.report(window.steps, lg.timing_log_option))
        self.timers.reset()
        return record

    def mfu(self, iteration: int, flops_per_device: float) -> float:
        """Model FLOPs utilization, at most 1: a step faster than the peak raises the peak (once said)."""
        mfu, peak, raised = bounded_mfu(flops_per_device, self.peak_flops)
        if raised:
            if not self.peak_raised:
                self.writer.info(
                    f"warning: step {iteration} ran at {flops_per_device / 1e12:.3f} TFLOP/s/device, above the peak "
                    f"of {self.peak_flops / 1e12:.3f} used for MFU (a matmul probe slowed by other work on the "
                    "machine, or a low --peak-tflops); MFU is measured against the fastest step from now on"
                )
            self.peak_raised = True
            self.peak_flops = peak
        return mfu

    def dp_mean(self, value: torch.Tensor) -> float:
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
