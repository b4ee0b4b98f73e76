"""What the debugging and measuring flags add around a training step, kept apart from the loop.

--timing-log-level's timers, --profile's trace, --log-straggler, --debug-capture, --log-layer-stats,
--log-memory's first-step report, --compile's report and --profile-pipeline's timeline: each is
built here from the configuration and asked at its moment by the loop (`training/loop.py`), which
then reads as the order of its steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from paratron.config.schema import Config
from paratron.debugging.capture import install_capture
from paratron.debugging.layer_stats import LayerStats
from paratron.debugging.stragglers import StragglerDetector
from paratron.distributed.init import DistributedContext
from paratron.distributed.topology import Topology
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.compile import CompileReport
from paratron.parallel.model import ParallelModel
from paratron.parallel.pipeline.profile import profile_step
from paratron.training.memory_report import SavedActivations, rank_memory, report_memory
from paratron.training.metrics import tensorboard_folder
from paratron.training.profiling import StepProfiler, StepTimers, collect_after_step
from paratron.training.step_log import StepWindow


class StepInstruments:
    """The flags' instruments of one run and their moments in a step."""

    def __init__(
        self,
        config: Config,
        ctx: DistributedContext,
        topology: Topology,
        model: ParallelModel,
        optimizer: TrainingOptimizer,
        loss_scale: Callable[[], float],
        global_batch_size: int,
        info: Callable[[str], None],
    ) -> None:
        lg = config.logging
        self.config, self.ctx, self.topology, self.model, self.optimizer = config, ctx, topology, model, optimizer
        self.info = info
        self.capture = install_capture(config, topology, model, loss_scale, global_batch_size)
        """--debug-capture: records each step's module outputs and gradients (debugging/capture.py)."""
        self.timers = StepTimers(lg.timing_log_level, ctx.device)  # --timing-log-level's timers of this rank
        self.profiler = StepProfiler(lg, ctx.rank, ctx.device, tensorboard_folder(Path(lg.run_dir), lg))
        self.stragglers = StragglerDetector(lg.straggler_threshold, topology, ctx.device)
        self.layer_stats = LayerStats(model, optimizer, config.parallel.sequence_parallel, lg.log_layer_stats)

    def pipeline_profiled(self, iteration: int) -> bool:
        """--profile-pipeline records the last step of the run (the ranks' clocks start together)."""
        pipeline = self.model.pipeline
        profiling = self.config.logging.profile_pipeline and pipeline is not None
        if not (profiling and iteration == self.config.training.train_iters):
            return False
        dist.barrier()
        pipeline.record = True
        return True

    @contextlib.contextmanager
    def around_step(self, iteration: int, measuring: bool) -> Iterator[SavedActivations | None]:
        """The step's capture, straggler timing and (on the first step with --log-memory) its saved activations."""
        self.profiler.begin(iteration)
        with (
            self.capture.step(iteration) if self.capture is not None else contextlib.nullcontext(),
            SavedActivations(self.model.module) if measuring else contextlib.nullcontext() as activations,
            self.stragglers.timing(),
        ):
            yield activations

    def after_first_step(self, activations: SavedActivations | None, step_start: float) -> None:
        """Rank 0's training state (every rank's with --log-memory, memory.json) and what --compile made
        during the first step (which compiled the blocks, so its time is mostly that)."""
        report = rank_memory(self.model, self.optimizer, activations, self.ctx.device)
        run_dir = Path(self.config.logging.run_dir)
        report_memory(report, self.topology, run_dir, self.ctx.is_main, self.info)
        t = self.config.training
        if t.compile:
            made, seconds = CompileReport.now(), time.perf_counter() - step_start
            self.info(
                f"compile ({t.compile_backend}): {made.graphs} graph(s) for the blocks, {made.graph_breaks} graph "
                f"break(s); the first step, which compiled them, took {seconds:.1f} s"
            )

    def after_pipeline_profiled(self, iteration: int) -> None:
        """--profile-pipeline: the traces and timeline of the step the pipeline just recorded."""
        pipeline = self.model.pipeline
        assert pipeline is not None
        pipeline.record = False
        line = profile_step(pipeline, iteration, Path(self.config.logging.run_dir), self.topology, self.ctx.is_main)
        if line is not None:
            self.info(line)

    def after_step(self, iteration: int, window: StepWindow) -> None:
        """--profile's trace after its last step (not part of the steps' speed), --manual-gc."""
        with window.paused():
            trace = self.profiler.finish_step(iteration)
            if trace is not None:
                print(f"rank {self.ctx.rank}: profile of steps {self.profiler.start}-{self.profiler.end - 1}: {trace}")
        collect_after_step(self.config.training, iteration)

    def finish_profile(self) -> None:
        """Write the --profile trace of a run that stopped before --profile-step-end."""
        trace = self.profiler.close()
        if trace is not None:
            print(f"rank {self.ctx.rank}: profile (cut short by the end of training): {trace}")
