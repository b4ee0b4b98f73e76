"""The loss-curve PNG of a run, drawn from its metrics.jsonl and eval.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_loss_curve(run_dir: Path, title: str = "") -> Path:
    """Write RUN_DIR/loss.png (train loss per logged step, validation loss per evaluation)."""
    import matplotlib  # (lazy for start-up speed, as matplotlib is only needed at the end)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = _read(run_dir / "metrics.jsonl")
    valid = _read(run_dir / "eval.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", color="tab:blue")
    if valid:
        ax.plot(
            [r["step"] for r in valid], [r["val_loss"] for r in valid], "o-", label="validation", color="tab:orange"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or f"loss: {run_dir}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss.png"
    tmp = run_dir / ".loss.png.tmp"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out
