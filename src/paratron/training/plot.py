"""The PNGs of a run: its loss curve (from metrics.jsonl and eval.jsonl) and, with experts, their
load over the logged steps (`--log-expert-load`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from paratron.storage import save_figure, write_text_atomic


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_loss_curve(run_dir: Path, title: str = "") -> Path:
    """Write RUN_DIR/loss.png (train loss per logged step, validation loss per evaluation)."""
    import matplotlib  # (lazy for start-up speed, docs/architecture.md: needed only at the end)

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
    out = save_figure(fig, run_dir / "loss.png", "the loss curve", "free space or choose another --run-dir")
    plt.close(fig)
    return out


def plot_expert_load(history: list[tuple[int, np.ndarray]], run_dir: Path) -> Path:
    """Write expert_load.png and expert_load.json from (step, shares [layers, experts]) records."""
    import matplotlib  # (lazy for start-up speed, docs/architecture.md: needed only at the end)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step, _ in history]
    shares = np.stack([s for _, s in history], axis=1)  # [layers, steps, experts]
    layers, _, experts = shares.shape
    figure, axes = plt.subplots(1, layers, figsize=(3 + 2.5 * layers, 3.5), squeeze=False)
    for layer, axis in enumerate(axes[0]):
        image = axis.imshow(
            shares[layer].T, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=float(shares.max())
        )
        axis.set_title(f"MoE layer {layer}")
        axis.set_xlabel("logged step")
        axis.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6, rotation=90)
        axis.set_yticks(range(experts))
        if layer == 0:
            axis.set_ylabel("expert")
    figure.colorbar(image, ax=list(axes[0]), label="share of the tokens")
    path = save_figure(figure, run_dir / "expert_load.png", "the experts' load", "free space", dpi=110)
    plt.close(figure)
    record = {"steps": steps, "shares": shares.tolist(), "experts": experts}
    write_text_atomic(run_dir / "expert_load.json", json.dumps(record) + "\n")
    return path
