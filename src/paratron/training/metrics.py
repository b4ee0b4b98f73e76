"""Where metrics go: the console (with a live progress bar), metrics.jsonl, eval.jsonl, TensorBoard,
Weights & Biases (with --wandb-project) and progress.txt (with --log-progress).

Only rank 0 writes; other ranks get a writer that does nothing. Every logged quantity is a key of
the step's record: metrics.jsonl holds them all, TensorBoard and wandb get them as train/KEY
(lists as train/KEY/0, ...) except those a --no-log-...-to-tensorboard flag leaves out and the
timers without --log-timers-to-tensorboard.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from paratron.config.fields import flag
from paratron.config.schema import LoggingConfig
from paratron.errors import ConfigError
from paratron.storage import write_text_atomic

TASK_PREFIX = "tasks/"
"""Keys of a step's record holding `train --eval-tasks`' metrics (`tasks/<task>/<metric>`); TensorBoard and wandb
get them under this name, not under train/."""


def format_step_line(record: dict[str, Any], total_iters: int) -> str:
    norm = "skipped" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"
    line = (
        f"step {record['step']:>{len(str(total_iters))}}/{total_iters} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.3e} | grad norm {norm} | "
        f"{record['tokens_per_s']:,.0f} tok/s | {record['tflops_per_device']:.3f} TFLOP/s/dev | "
        f"MFU {100 * record['mfu']:.1f}% | mem {record['mem_gb']:.2f} GB"
    )
    if "throughput" in record:
        line += f" | throughput per GPU (TFLOP/s/GPU): {record['throughput']:.1f}"
    if "loss_scale" in record:
        line += f" | loss scale {record['loss_scale']:g} | skipped {record['skipped_iterations']}"
    if record.get("num_zeros_in_grad") is not None:
        line += f" | num zeros {record['num_zeros_in_grad']:,.0f}"
    if record.get("params_norm") is not None:
        line += f" | params norm {record['params_norm']:.3f}"
    if "moe_load_balance" in record:
        aux, z, load = record["moe_aux_loss"], record["moe_z_loss"], record["moe_load_balance"]
        line += f" | MoE aux {aux:.4f} z {z:.4f} load {load:.2f}"
    for key, value in record.items():
        if key.startswith(TASK_PREFIX):
            line += f" | {key[len(TASK_PREFIX) :]} {value:.4f}"
    return line


def format_timers_line(record: dict[str, Any]) -> str | None:
    """Milliseconds per step of each timer in `record` (NAME-time keys), as Megatron-LM prints them:
    (min, max) over ranks, the max, or every rank's."""
    parts = []
    for key, value in record.items():
        if not key.endswith("-time") or key == "iteration-time":
            continue
        name = key.removesuffix("-time")
        if isinstance(value, list):
            parts.append(f"{name} " + ", ".join(f"{1000 * v:.2f}" for v in value))
        elif f"{key}-min" in record:
            parts.append(f"{name} ({1000 * record[key + '-min']:.2f}, {1000 * value:.2f})")
        else:
            parts.append(f"{name} {1000 * value:.2f}")
    if not parts:
        return None
    return "  time per step across ranks (ms): " + " | ".join(parts)


def is_timer(key: str) -> bool:
    return key == "iteration-time" or key.endswith("-time") or key.endswith("-time-min")


def hidden_from_tensorboard(logging: LoggingConfig) -> set[str]:
    """Record keys that go to metrics.jsonl but not to TensorBoard or wandb, by the flags."""
    hidden = set()
    if not logging.log_learning_rate_to_tensorboard:
        hidden.add("lr")
    if not logging.log_loss_scale_to_tensorboard:
        hidden.add("loss_scale")
    return hidden


def require_wandb(logging: LoggingConfig) -> None:
    """With --wandb-project, the wandb package must be importable (checked before training)."""
    if not logging.wandb_project:
        return
    try:
        found = importlib.util.find_spec("wandb") is not None
    except ValueError:  # (in sys.modules without a spec: a stand-in put there on purpose)
        found = True
    if not found:
        raise ConfigError(f"{flag.wandb_project} needs the wandb package, which is not installed: pip install wandb")


def open_wandb(logging: LoggingConfig, run_dir: Path, settings: dict[str, Any]) -> Any:
    """Start the wandb run (offline unless WANDB_MODE says otherwise: a cluster node often has no
    network; `wandb sync` uploads later)."""
    require_wandb(logging)
    import wandb  # (start-up speed, docs/architecture.md; an optional dependency, imported only when asked for)

    os.environ.setdefault("WANDB_MODE", "offline")
    folder = Path(logging.wandb_save_dir) if logging.wandb_save_dir else run_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=logging.wandb_project,
        entity=logging.wandb_entity,
        name=logging.wandb_exp_name or run_dir.resolve().name,
        dir=str(folder),
        config=settings,
    )


def _open_log(path: Path, start_iter: int) -> TextIO:
    """Open a JSON-lines log for appending after step `start_iter`: a fresh run starts it anew; a resumed
    run keeps the records up to its checkpoint and drops later ones (written after the last save)."""
    if start_iter > 0 and path.exists():
        kept = [
            line
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line)["step"] <= start_iter
        ]
        write_text_atomic(path, "".join(line + "\n" for line in kept))
        return open(path, "a", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def scalars(tag: str, value: Any) -> list[tuple[str, float]]:
    """TensorBoard's scalars of one metrics record entry: a number as itself, a list (per MoE layer,
    per expert) as one scalar per entry, tagged by its position (tag/0, tag/0/3, ...); None or text as none."""
    if isinstance(value, str):
        return []
    if isinstance(value, (list, tuple)):
        return [pair for i, item in enumerate(value) for pair in scalars(f"{tag}/{i}", item)]
    return [] if value is None else [(tag, float(value))]


def wants_progress_bar(setting: bool | None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> bool:
    """--progress-bar, or when it is unset whether both streams (the log lines' and the bar's) are
    terminals: a bar redrawn into a log file (Slurm, nohup, a redirect) buries the log lines. The
    workers of `paratron train --nproc N` write to the launcher's own streams, so rank 0 sees the
    terminal the user sees."""
    if setting is not None:
        return setting
    streams = (stdout or sys.stdout, stderr or sys.stderr)
    return all(callable(getattr(s, "isatty", None)) and s.isatty() for s in streams)


class MetricsWriter:
    """Rank 0's sinks. Use as a context manager so files are flushed and closed."""

    def __init__(
        self,
        run_dir: Path,
        total_iters: int,
        start_iter: int,
        enabled: bool,
        progress_bar: bool | None,
        tensorboard: bool,
        logging: LoggingConfig | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """`progress_bar`: --progress-bar (None: only on a terminal, `wants_progress_bar`); `logging`: the
        Megatron-LM logging flags (TensorBoard directory, interval and queue, what it leaves out, wandb);
        `settings`: the run's configuration, for wandb."""
        self.enabled = enabled
        self.total_iters, self.start_iter = total_iters, start_iter
        self.show_bar = wants_progress_bar(progress_bar) if enabled else False
        self.bar: tqdm | None = None
        self.tb = None
        self.wandb = None
        self.logging = logging or LoggingConfig()
        self.hidden = hidden_from_tensorboard(self.logging)
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.train_file = _open_log(run_dir / "metrics.jsonl", start_iter)
        self.eval_file = _open_log(run_dir / "eval.jsonl", start_iter)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # (start-up speed, docs/architecture.md)

            folder = tensorboard_folder(run_dir, self.logging)
            self.tb = SummaryWriter(str(folder), max_queue=self.logging.tensorboard_queue_size)
        if self.logging.wandb_project:
            self.wandb = open_wandb(self.logging, run_dir, settings or {})

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        """Scalars to TensorBoard and wandb at `step` (every --tensorboard-log-interval steps)."""
        if not values or step % self.logging.tensorboard_log_interval:
            return
        if self.tb is not None:
            for tag, number in values.items():
                self.tb.add_scalar(tag, number, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def rewind(self, iteration: int) -> None:
        """Forget the records after `iteration` (training went back to a checkpoint)."""
        self.start_iter = iteration
        if not self.enabled:
            return
        for name in ("train_file", "eval_file"):
            handle = getattr(self, name)
            handle.close()
            setattr(self, name, _open_log(Path(handle.name), iteration))

    @classmethod
    def disabled(cls) -> MetricsWriter:
        """A writer that writes nothing (ranks other than 0, benchmarks)."""
        return cls(Path("."), 0, 0, enabled=False, progress_bar=False, tensorboard=False)

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def advance(self) -> None:
        """One step done; the bar appears with the first step, below whatever was printed before."""
        if self.enabled and self.show_bar and self.bar is None:
            self.bar = tqdm(
                total=self.total_iters,
                initial=self.start_iter,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                smoothing=0.1,
            )
        if self.bar is not None:
            self.bar.update(1)

    def log_step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.train_file.write(json.dumps(record) + "\n")
        self.train_file.flush()
        timers = self.logging.log_timers_to_tensorboard
        shown = {
            tag: number
            for key, value in record.items()
            if key != "step" and key not in self.hidden and (timers or not is_timer(key))
            for tag, number in scalars(key if key.startswith(TASK_PREFIX) else f"train/{key}", value)
        }
        self._scalars(record["step"], shown)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self.info(format_step_line(record, self.total_iters))
        timers_line = format_timers_line(record)
        if timers_line is not None:
            self.info(timers_line)

    def log_eval(self, step: int, loss: float, tasks: dict[str, dict[str, float]] | None = None) -> None:
        """One validation: the overall per-token loss and, with several tasks, each task's
        {"loss", "tokens"}."""
        if not self.enabled:
            return
        record: dict[str, Any] = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        if tasks:
            record["tasks"] = tasks
        self.eval_file.write(json.dumps(record) + "\n")
        self.eval_file.flush()
        values = {"valid/loss": loss}
        if self.logging.log_validation_ppl_to_tensorboard:
            values["valid/ppl"] = record["val_ppl"]
        for name, task in (tasks or {}).items():
            values[f"valid/{name}/loss"] = task["loss"]
            if self.logging.log_validation_ppl_to_tensorboard:
                values[f"valid/{name}/ppl"] = math.exp(min(task["loss"], 50.0))
        self._scalars(step, values)
        self.info(f"validation at step {step}: loss {loss:.4f} | perplexity {record['val_ppl']:.2f}")
        for name, task in (tasks or {}).items():
            self.info(f"  task {name}: loss {task['loss']:.4f} over {task['tokens']:,.0f} tokens")

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.train_file.close()
        self.eval_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensorboard_folder(run_dir: Path, logging: LoggingConfig) -> Path:
    """--tensorboard-dir, or the run directory's tensorboard/ folder."""
    return Path(logging.tensorboard_dir) if logging.tensorboard_dir else run_dir / "tensorboard"


class ProgressLog:
    """--log-progress: progress.txt in the --save directory, in Megatron-LM's tab-separated format
    (time, job id, number of devices, event): "Starting job" when a job starts and, after each
    saved checkpoint, the job's throughput since it started, the cumulative throughput since the
    first job of this world size started, the floating-point operations and the tokens so far."""

    def __init__(self, save_dir: Path, world_size: int, flops_so_far: float, enabled: bool) -> None:
        self.path = save_dir / "progress.txt"
        self.world_size, self.enabled = world_size, enabled
        self.start_flops, self.started = flops_so_far, time.time()
        if enabled:
            save_dir.mkdir(parents=True, exist_ok=True)
            self._append("Starting job")

    def _append(self, event: str) -> None:
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        job = os.environ.get("SLURM_JOB_ID", "")
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{stamp}\tJob ID: {job}\t# GPUs: {self.world_size}\t{event}\n")

    def saved(self, iteration: int, flops_so_far: float, tokens_so_far: int, background: bool) -> None:
        """One checkpoint saved (or, with --async-save, being saved) at `iteration`."""
        if not self.enabled:
            return
        per_device = 1e12 * self.world_size
        job = (flops_so_far - self.start_flops) / (max(time.time() - self.started, 1e-9) * per_device)
        first_start, first_flops = self._first_start()
        cumulative = (flops_so_far - first_flops) / (max(time.time() - first_start, 1e-9) * per_device)
        what = "Saving async checkpoint" if background else "Saved checkpoint"
        self._append(
            f"{what}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops_so_far:.2e}\tTokens (in billions): {tokens_so_far / 1e9:.2f}"
        )

    def _first_start(self) -> tuple[float, float]:
        """When the first job of the current run of this world size started (as a time stamp) and
        the operations done by then (those of the last checkpoint saved before it)."""
        start, start_flops, last_saved = None, None, 0.0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            fields = line.split("\t")
            if len(fields) < 4:
                continue
            if fields[3] in ("Saved checkpoint", "Saving async checkpoint") and len(fields) > 7:
                last_saved = float(fields[7].split(": ")[1])
            if fields[2] != f"# GPUs: {self.world_size}":
                start, start_flops = None, None
                continue
            if fields[3] == "Starting job" and start is None:
                start = datetime.strptime(fields[0], "%Y-%m-%d %H:%M:%S").timestamp()
                start_flops = last_saved
        if start is None or start_flops is None:
            return self.started, self.start_flops
        return start, start_flops
