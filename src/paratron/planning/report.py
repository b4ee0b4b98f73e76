"""What `paratron plan` shows and writes: a table of the best plans, plans.json with every plan
the search kept and every other layout it considered (with why, and what is known of it), and a
PNG comparing the best plans' step time and memory breakdowns.

Files are written to a temporary name and renamed into place, so a stopped run never leaves a
half-written one, and a full disk says so in one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from paratron.planning.hardware import Hardware
from paratron.planning.memory_prediction import CATEGORIES, RankMemory
from paratron.planning.operations import PARTS
from paratron.planning.search import Plan, Unpriced
from paratron.storage import save_figure, write_text_atomic

TIME_PARTS = (*PARTS, "bubble", "optimizer")
SHORT = {
    "compute": "comp",
    "tensor_parallel": "TP",
    "context_parallel": "CP",
    "expert_parallel": "EP",
    "pipeline_p2p": "p2p",
    "data_parallel": "DP",
    "bubble": "bubble",
    "optimizer": "opt",
}


def fullest(plan: Plan) -> Any:
    """The RankMemory of the plan's fullest pipeline stage."""
    return max(plan.memory, key=lambda m: m.total)


def table(plans: list[Plan], top: int = 10) -> str:
    """The best `top` plans as a fixed-width table: layout, memory of the fullest rank (training
    state / activations / buffers), step time and where it goes, tokens/s, MFU."""
    head = f"{'#':>3}  {'layout':<58} {'GB/rank (state+act+buf)':<25} {'step s':>7}  {'time split (%)':<44}"
    head += f" {'tokens/s':>11} {'MFU':>6}"
    lines = [head, "-" * len(head)]
    for i, plan in enumerate(plans[:top], 1):
        m, p = fullest(plan), plan.prediction
        memory = f"{m.total / 1e9:6.1f} ({m.state / 1e9:.1f}+{m.activations / 1e9:.1f}+{m.buffers / 1e9:.1f})"
        split = " ".join(f"{SHORT[k]} {100 * v / p.total:.0f}" for k, v in p.breakdown.items() if v / p.total >= 0.005)
        lines.append(
            f"{i:>3}  {plan.describe():<58} {memory:<25} {p.total:7.3f}  {split:<44} {p.tokens_per_s:11,.0f} "
            f"{100 * p.mfu:5.1f}%"
        )
    return "\n".join(lines)


def plan_record(plan: Plan) -> dict[str, Any]:
    """One plan as plain data (plans.json)."""
    p = plan.prediction
    return {
        "layout": plan.describe(),
        "settings": plan.settings,
        "world_size": plan.layout.world_size,
        "data_parallel_size": plan.layout.dp,
        "micro_batches": plan.layout.num_micro_batches,
        "pipeline": {
            "schedule": plan.layout.pipeline.schedule,
            "chunks": plan.layout.pipeline.chunks,
            "layers_per_stage": list(plan.layout.pipeline.counts),
        },
        "memory_per_rank": memory_records(plan.memory),
        "peak_memory_bytes": plan.peak_memory,
        "step_time_s": p.total,
        "step_time_breakdown_s": p.breakdown,
        "bubble_fraction": p.throughput.bubble_fraction,
        "tokens_per_s": p.tokens_per_s,
        "model_tflops_per_device": p.model_tflops_per_device,
        "mfu": p.mfu,
        "command": plan.command(),
        "slurm_command": plan.slurm_command(),
    }


def memory_records(memory: tuple[RankMemory, ...]) -> list[dict[str, Any]]:
    """Each pipeline stage's predicted bytes per rank, by category."""
    return [
        {"stage": m.stage, "ranks": m.ranks, **{c: getattr(m, c) for c in CATEGORIES}, "total": m.total} for m in memory
    ]


def unpriced_record(other: Unpriced) -> dict[str, Any]:
    """A layout the search considered and did not keep, as plain data (plans.json): why, its step
    time (exact, or the bound that excluded it), its memory where computed, its command."""
    return {
        "layout": other.describe(),
        "reason": other.reason,
        "detail": other.detail,
        "settings": other.settings,
        "step_time_s": other.step_time_s,
        "step_time_at_least_s": other.step_time_bound_s,
        "memory_per_rank": memory_records(other.memory) if other.memory is not None else None,
        "peak_memory_bytes": max(m.total for m in other.memory) if other.memory is not None else None,
        "command": other.command(),
        "slurm_command": other.slurm_command(),
    }


def write_json(
    path: Path, plans: list[Plan], hardware: Hardware, request: dict[str, Any], others: list[Unpriced] = ()
) -> None:
    """plans.json: the request, the hardware, every plan (fastest first) and every other layout the
    search considered (fastest known step time first), atomically."""
    document = {
        "request": request,
        "hardware": dataclasses.asdict(hardware),
        "plans": [plan_record(p) for p in plans],
        "other_layouts": [unpriced_record(u) for u in others],
    }
    text = json.dumps(document, indent=1, default=str) + "\n"
    write_text_atomic(Path(path), text, "the plans", "free space or choose another --output")


def plot(plans: list[Plan], path: Path, top: int = 8) -> Path:
    """Stacked bars of the best plans' step time (by part) and fullest rank's memory (by category)."""
    import matplotlib  # (lazy for start-up speed, docs/architecture.md: only the plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plans[:top]
    labels = [f"{i}. {p.describe()}" for i, p in enumerate(shown, 1)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.55 * len(shown) + 2.8), sharey=True)
    rows = range(len(shown))
    start = [0.0] * len(shown)
    for part in TIME_PARTS:
        values = [p.prediction.breakdown[part] for p in shown]
        if any(values):
            left.barh(rows, values, left=start, label=SHORT[part])
            start = [a + b for a, b in zip(start, values)]
    left.set_xlabel("step time (s)")
    left.set_yticks(list(rows), labels, fontsize=8)
    left.invert_yaxis()
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4, frameon=False)
    start = [0.0] * len(shown)
    for category in CATEGORIES:
        values = [getattr(fullest(p), category) / 1e9 for p in shown]
        if any(values):
            right.barh(rows, values, left=start, label=category.replace("_", " "))
            start = [a + b for a, b in zip(start, values)]
    right.set_xlabel("memory of the fullest rank (GB)")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    fig.suptitle("paratron plan: the best layouts")
    fig.tight_layout()
    save_figure(fig, Path(path), "the plans' plot", "free space or choose another --plot", dpi=110)
    plt.close(fig)
    return Path(path)
