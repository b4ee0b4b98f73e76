"""Where metrics go: the console (with a live progress bar), metrics.jsonl, eval.jsonl, TensorBoard.

Only rank 0 writes; other ranks get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


def format_step_line(record: dict[str, Any], total_iters: int) -> str:
    norm = "skipped" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"
    line = (
        f"step {record['step']:>{len(str(total_iters))}}/{total_iters} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.3e} | grad norm {norm} | "
        f"{record['tokens_per_s']:,.0f} tok/s | {record['tflops_per_device']:.3f} TFLOP/s/dev | "
        f"MFU {100 * record['mfu']:.1f}% | mem {record['mem_gb']:.2f} GB"
    )
    if "loss_scale" in record:
        line += f" | loss scale {record['loss_scale']:g} | skipped {record['skipped_iterations']}"
    if "moe_load_balance" in record:
        aux, z, load = record["moe_aux_loss"], record["moe_z_loss"], record["moe_load_balance"]
        line += f" | MoE aux {aux:.4f} z {z:.4f} load {load:.2f}"
    return line


def _open_log(path: Path, start_iter: int) -> TextIO:
    """Open a JSON-lines log for appending after step `start_iter`: a fresh run starts it anew; a resumed
    run keeps the records up to its checkpoint and drops later ones (written after the last save)."""
    if start_iter > 0 and path.exists():
        kept = [
            line
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line)["step"] <= start_iter
        ]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
        return open(path, "a", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def scalars(tag: str, value: Any) -> list[tuple[str, float]]:
    """TensorBoard's scalars of one metrics record entry: a number as itself, a list (per MoE layer,
    per expert) as one scalar per entry, tagged by its position (tag/0, tag/0/3, ...); None as none."""
    if isinstance(value, (list, tuple)):
        return [pair for i, item in enumerate(value) for pair in scalars(f"{tag}/{i}", item)]
    return [] if value is None else [(tag, float(value))]


class MetricsWriter:
    """Rank 0's sinks. Use as a context manager so files are flushed and closed."""

    def __init__(
        self, run_dir: Path, total_iters: int, start_iter: int, enabled: bool, progress_bar: bool, tensorboard: bool
    ) -> None:
        self.enabled = enabled
        self.total_iters, self.start_iter = total_iters, start_iter
        self.show_bar = progress_bar
        self.bar: tqdm | None = None
        self.tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.train_file = _open_log(run_dir / "metrics.jsonl", start_iter)
        self.eval_file = _open_log(run_dir / "eval.jsonl", start_iter)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # (lazy for start-up speed: TensorBoard is heavy)

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

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
        if self.tb is not None:
            for key, value in record.items():
                if key != "step":
                    for tag, number in scalars(f"train/{key}", value):
                        self.tb.add_scalar(tag, number, record["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self.info(format_step_line(record, self.total_iters))

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
        if self.tb is not None:
            self.tb.add_scalar("valid/loss", loss, step)
            for name, task in (tasks or {}).items():
                self.tb.add_scalar(f"valid/{name}/loss", task["loss"], step)
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

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
