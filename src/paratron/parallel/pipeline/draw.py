"""Pictures of pipeline schedules: a PNG timeline and a Chrome trace.

Both take the same spans, `(Action, start, end)` per rank, so a simulated schedule and a
measured run can be drawn alike and laid side by side. matplotlib is imported inside the
functions: the runtime imports this module, and most runs never draw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paratron.parallel.pipeline.schedules import Span
from paratron.storage import save_figure, write_text_atomic

_COLOURS = {"F": "#3b75af", "B": "#e1812c", "W": "#3a923a"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradients"}
_LABEL_PX_PER_CHAR = 6.0  # a box narrower than its label's characters times this stays unlabelled


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Chunk 0 in the full colour, later chunks mixed with more white, so chunks stay apart
    while the kind stays recognisable."""
    from matplotlib.colors import to_rgb  # (lazy for start-up speed, docs/architecture.md)

    if chunks <= 1:
        return to_rgb(colour)
    mix = 0.6 * chunk / (chunks - 1)
    return tuple(c + (1.0 - c) * mix for c in to_rgb(colour))  # type: ignore[return-value]


def draw_timeline(spans: list[list[Span]], path: Path, title: str, unit: str = "") -> Path:
    """Draw one row per rank (rank 0 on top) with a box per operation; write a PNG to `path`."""
    # (matplotlib is imported lazily, for start-up speed: most runs never draw; docs/architecture.md)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    ranks = len(spans)
    chunks = 1 + max((a.chunk for row in spans for a, _, _ in row), default=0)
    t0 = min((s for row in spans for _, s, _ in row), default=0.0)
    t1 = max((e for row in spans for _, _, e in row), default=1.0)
    t1 = t1 if t1 > t0 else t0 + 1.0

    fig = Figure(figsize=(12, min(1.2 + 0.45 * max(ranks, 1), 24)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlim(t0, t1)
    ax.set_ylim(ranks - 0.5, -0.5)
    fig.tight_layout()  # settle the axes' size first: labels are placed by their width in pixels
    px_per_unit = ax.get_position().width * fig.get_figwidth() * fig.dpi / (t1 - t0)

    present: set[tuple[str, int]] = set()
    for rank, row in enumerate(spans):
        present |= _draw_row(ax, rank, row, chunks, px_per_unit)

    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_xlabel(f"time {unit}".strip())
    ax.set_title(title)
    handles = _legend_handles(present, chunks)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path, "the pipeline timeline", "free space or choose another --output")


def _draw_row(ax: Any, rank: int, row: list[Span], chunks: int, px_per_unit: float) -> set[tuple[str, int]]:
    """Draw one rank's boxes, one bar series per (kind, chunk), labelling those wide enough with their
    micro-batch; returns the (kind, chunk) pairs drawn, for the legend."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for action, start, end in row:
        groups.setdefault((action.kind, action.chunk), []).append((start, end - start))
        label = str(action.microbatch)
        if (end - start) * px_per_unit >= _LABEL_PX_PER_CHAR * len(label) + 2:
            ax.text(
                (start + end) / 2,
                rank,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if action.chunk == 0 or chunks == 1 else "black",
            )
    for (kind, chunk), boxes in groups.items():
        ax.broken_barh(
            boxes,
            (rank - 0.4, 0.8),
            facecolors=_shade(_COLOURS.get(kind, "grey"), chunk, chunks),
            edgecolors="white",
            linewidth=0.5,
        )
    return set(groups)


def _legend_handles(present: set[tuple[str, int]], chunks: int) -> list[Any]:
    """One legend entry per (kind, chunk) drawn, in F, B, W order; B is named input gradients when W is there."""
    from matplotlib.patches import Patch  # (lazy for start-up speed, docs/architecture.md)

    split = any(kind == "W" for kind, _ in present)
    handles = []
    for kind, chunk in sorted(present, key=lambda kc: ("FBW".find(kc[0]), kc[1])):
        name = "backward (input gradients)" if kind == "B" and split else _NAMES.get(kind, kind)
        label = f"{kind} {name}" + (f", chunk {chunk}" if chunks > 1 else "")
        handles.append(Patch(facecolor=_shade(_COLOURS.get(kind, "grey"), chunk, chunks), label=label))
    return handles


def write_chrome_trace(path: Path, spans_per_rank: dict[int, list[Span]]) -> Path:
    """Write the spans (in milliseconds) as Chrome trace events, one thread per pipeline rank,
    for Perfetto or chrome://tracing."""
    events: list[dict] = []
    for rank in sorted(spans_per_rank):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"pipeline rank {rank}"}}
        )
        for action, start, end in spans_per_rank[rank]:
            events.append(
                {
                    "name": str(action),
                    "cat": action.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": start * 1000.0,
                    "dur": (end - start) * 1000.0,
                    "args": {"microbatch": action.microbatch, "chunk": action.chunk},
                }
            )
    text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    write_text_atomic(Path(path), text, "the pipeline trace")
    return Path(path)
