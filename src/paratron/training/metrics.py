"""Where metrics go: the console (with a live progress bar), metrics.jsonl, eval.jsonl, TensorBoard.

Only rank 0 writes; other ranks get a writer that does nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


def format_step_line(record: dict[str, Any], total_iters: int) -> str:
    return (f"step {record['step']:>{len(str(total_iters))}}/{total_iters} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:,.0f} tok/s | {record['tflops_per_device']:.3f} TFLOP/s/dev | "
            f"MFU {100 * record['mfu']:.1f}% | mem {record['mem_gb']:.2f} GB")


class MetricsWriter:
    """Rank 0's sinks. Use as a context manager so files are flushed and closed."""

    def __init__(self, run_dir: Path, total_iters: int, start_iter: int, enabled: bool,
                 progress_bar: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.total_iters = total_iters
        self.bar = None
        self.tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        mode = "a" if start_iter > 0 else "w"
        self.train_file = open(run_dir / "metrics.jsonl", mode, encoding="utf-8")
        self.eval_file = open(run_dir / "eval.jsonl", mode, encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if progress_bar:
            self.bar = tqdm(total=total_iters, initial=start_iter, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr, smoothing=0.1)

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def advance(self) -> None:
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
                    self.tb.add_scalar(f"train/{key}", value, record["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self.info(format_step_line(record, self.total_iters))

    def log_eval(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        import math

        record = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        self.eval_file.write(json.dumps(record) + "\n")
        self.eval_file.flush()
        if self.tb is not None:
            self.tb.add_scalar("valid/loss", loss, step)
        self.info(f"validation at step {step}: loss {loss:.4f} | perplexity {record['val_ppl']:.2f}")

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

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
