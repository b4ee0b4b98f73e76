"""Two runs' captures (debugging/capture.py) side by side: the first place where they part, and a
table per layer of how far apart they are.

Differences are relative: max |a - b| over the kept elements divided by max |b| (b is the
reference run), and the same for the whole tensor's rms and largest magnitude, so a difference
outside the kept elements shows too. "First" follows the step order, and within a step the
forward outputs in the order the modules ran, then the gradients from the last to the first
parameter (the order backward computes them). A replicated output on which the tensor-parallel
ranks of one run disagree parts there too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from paratron.debugging.capture import INDEX_FILE, block_of, step_file
from paratron.debugging.capture_sample import sample_indices
from paratron.errors import DataError

DEFAULT_TOL = 1e-4
"""Relative difference above which two runs part (fp32 layouts agree to ~1e-6)."""

SCALE_FLOOR = 1e-3
"""A tensor is measured against at least this fraction of the step's largest tensor of its kind (output or
gradient): one that is zero in exact arithmetic (a key bias's gradient) holds only rounding noise."""


@dataclass
class Entry:
    """One captured tensor of one step of one run."""

    kind: str
    name: str
    shape: tuple[int, ...]
    values: torch.Tensor
    rms: float
    max_abs: float
    disagreement: float


@dataclass
class Difference:
    """How one tensor of one step differs between the runs."""

    step: int
    phase: str
    """"forward" or "backward"."""
    name: str
    max_abs_diff: float
    rel_diff: float
    element: list[int] | None
    """Where |a - b| is largest (an index of the single-device tensor; None when the statistics differ)."""
    note: str = ""
    disagreement: float = 0.0
    """How far the tensor-parallel ranks of one run disagree on this replicated output (0: they agree)."""


@dataclass
class Report:
    tol: float
    steps: list[int]
    compared: int = 0
    first: Difference | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    """Per step and layer: the layer's forward output and its parameters' largest gradient rel. difference."""
    only_in_one: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values (an infinite difference, of shapes that differ, as null)."""
        return _plain(asdict(self))


def _plain(value: Any) -> Any:
    """`value` with every non-finite float as None (JSON has no infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def read_step(folder: Path, step: int) -> list[Entry]:
    """The captured tensors of one step, in the order the capture wrote them."""
    path = step_file(folder, step)
    if not path.is_file():
        raise DataError(f"{path} does not exist: the run captured no step {step}")
    with safe_open(str(path), framework="pt") as f:
        entries = json.loads(f.metadata()["entries"])
        return [
            Entry(
                e["kind"],
                e["name"],
                tuple(e["shape"]),
                f.get_tensor(f"{e['kind']}/{e['name']}"),
                e["rms"],
                e["max_abs"],
                e["disagreement"],
            )
            for e in entries
        ]


def read_index(folder: Path) -> dict[str, Any]:
    """A capture folder's index: its steps, the elements kept per tensor, the run's identity."""
    index = folder / INDEX_FILE
    if not index.is_file():
        raise DataError(f"{index} does not exist: {folder} holds no --debug-capture output")
    return json.loads(index.read_text())


def _relative(diff: float, scale: float) -> float:
    if math.isnan(diff):
        return math.inf
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def difference(step: int, a: Entry, b: Entry, limit: int, floor: float = 0.0) -> Difference:
    """How `a` differs from the reference `b` (the same tensor of the same step), relative to the
    larger of b's largest magnitude and `floor`."""
    phase = "forward" if a.kind == "forward" else "backward"
    if a.shape != b.shape:
        return Difference(step, phase, a.name, math.inf, math.inf, None, f"shapes differ: {a.shape} vs {b.shape}")
    both_nan = torch.isnan(a.values) & torch.isnan(b.values)
    diff = (a.values - b.values).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
    scale = max(float(b.values.abs().nan_to_num(nan=0.0).max()) if b.values.numel() else 0.0, floor)
    largest = int(diff.argmax()) if diff.numel() else -1
    max_diff = float(diff[largest]) if largest >= 0 else 0.0
    rel = _relative(max_diff, scale)
    element = None
    if largest >= 0:
        flat = sample_indices(a.shape, limit)[largest]
        element = [int(i) for i in torch.unravel_index(flat, a.shape)]
    stats = max(
        _relative(abs(a.rms - b.rms), max(b.rms, floor)), _relative(abs(a.max_abs - b.max_abs), max(b.max_abs, floor))
    )
    note = ""
    if stats > rel:
        rel, note = stats, "the whole tensor's rms or largest magnitude differs more than the kept elements"
    disagreement = max(a.disagreement, b.disagreement)
    if disagreement > 0:
        which = "A" if a.disagreement >= b.disagreement else "B"
        note = f"the tensor-parallel ranks of run {which} disagree on this replicated output ({disagreement:.3g})"
    return Difference(step, phase, a.name, max_diff, rel, element, note, disagreement)


def _in_order(entries: list[Entry]) -> list[Entry]:
    """Forward outputs in call order, then gradients from the last parameter to the first."""
    forward = [e for e in entries if e.kind == "forward"]
    gradients = [e for e in entries if e.kind == "gradient"]
    return forward + gradients[::-1]


def _layer_of(name: str) -> str:
    block = block_of(name)
    return f"layers.{block - 1}" if 0 < block < 10**6 else ("head" if block else "embedding")


def compare_captures(a: Path, b: Path, tol: float) -> Report:
    """Compare run A's captures with the reference B's, step by step."""
    index_a, index_b = read_index(a), read_index(b)
    limit = index_a["elements"]
    if index_b["elements"] != limit:
        raise DataError(f"{a} keeps {limit} elements per tensor, {b} {index_b['elements']}: capture both alike")
    steps = [s for s in index_b["steps"] if s in set(index_a["steps"])]
    if not steps:
        raise DataError(f"{a} (steps {index_a['steps']}) and {b} (steps {index_b['steps']}) share no captured step")
    report = Report(tol, steps)
    for step in steps:
        _compare_step(report, step, read_step(a, step), read_step(b, step), limit)
    report.only_in_one = sorted(set(report.only_in_one))
    return report


def _compare_step(report: Report, step: int, mine: list[Entry], reference: list[Entry], limit: int) -> None:
    """One step into `report`: its tensors in the reference's order, the first that parts, a row per layer."""
    theirs = {(e.kind, e.name): e for e in mine}
    known = {(e.kind, e.name) for e in reference}
    report.only_in_one += [f"{kind}/{name} (only in A)" for kind, name in theirs if (kind, name) not in known]
    floors = {
        kind: SCALE_FLOOR * max((e.max_abs for e in reference if e.kind == kind), default=0.0)
        for kind in ("forward", "gradient")
    }
    rows: dict[str, dict[str, Any]] = {}
    for ref in _in_order(reference):
        entry = theirs.get((ref.kind, ref.name))
        if entry is None:
            report.only_in_one.append(f"{ref.kind}/{ref.name} (only in B)")
            continue
        found = difference(step, entry, ref, limit, floors[ref.kind])
        report.compared += 1
        if report.first is None and (found.rel_diff > report.tol or found.disagreement > 0):
            report.first = found
        layer = _layer_of(ref.name)
        row = rows.setdefault(layer, {"step": step, "layer": layer, "forward": None, "gradient": 0.0})
        if ref.kind == "gradient":
            row["gradient"] = max(row["gradient"], found.rel_diff)
        elif ref.name == layer or not layer.startswith("layers."):  # (a block's output; the ends' largest)
            row["forward"] = max(row["forward"] or 0.0, found.rel_diff)
    report.layers += rows.values()


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3e}"


def format_report(report: Report) -> str:
    """The text the command prints: the verdict, the first difference, the table."""
    lines = []
    first = report.first
    if first is None:
        lines.append(
            f"the runs agree: {report.compared} tensors over steps {report.steps} within rel. tol {report.tol:g}"
        )
    else:
        where = f" at element {first.element}" if first.element is not None else ""
        if first.disagreement > 0:
            lines.append(f"the runs part at step {first.step}, {first.phase}, {first.name}: {first.note}")
            lines.append(f"  (against B: rel. diff {first.rel_diff:.3e}, max |a-b| {first.max_abs_diff:.3e}{where})")
        else:
            lines.append(
                f"the runs part at step {first.step}, {first.phase}, {first.name}: rel. diff {first.rel_diff:.3e} "
                f"> tol {report.tol:g} (max |a-b| {first.max_abs_diff:.3e}{where})"
            )
            if first.note:
                lines.append(f"  ({first.note})")
    lines.append("")
    lines.append(f"{'step':>4}  {'layer':<12} {'output rel. diff':>16} {'grad rel. diff':>16}")
    for row in report.layers:
        lines.append(
            f"{row['step']:>4}  {row['layer']:<12} {_number(row['forward']):>16} {_number(row['gradient']):>16}"
        )
    if report.only_in_one:
        shown = ", ".join(report.only_in_one[:6]) + (" ..." if len(report.only_in_one) > 6 else "")
        lines.append(f"captured by one run only (not compared): {shown}")
    return "\n".join(lines)
