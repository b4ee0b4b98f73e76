"""Pricing layouts with a cluster's measured figures: `paratron plan --calibration doctor.json`.

`paratron doctor --output doctor.json` times collectives of several sizes inside a node and across
nodes, a dense matmul, and reads each device's memory. This module reads that file and puts the
figures in place of the preset's spec-sheet numbers in the `Hardware` the cost model prices with:

- each network level (inside a node: groups with `spans_nodes` false; between nodes: true) gets
  an alpha-beta fit over every measured size and collective, in the ring's terms the cost model
  uses (`hardware.all_reduce_time` and its siblings): a collective of n ranks takes `steps` message
  steps of `chunk` bytes (all-reduce 2(n-1) steps of bytes/n, all-gather, reduce-scatter and
  all-to-all n-1 of bytes/n, send/recv one of all its bytes), so time = steps x (latency +
  chunk / bandwidth), fitted by least squares on the relative error (small messages set the
  latency, large ones the bandwidth); the bandwidth is then the ring's bus bandwidth;
- the achieved matmul TFLOP/s replaces peak x `matmul_efficiency` (the efficiency becomes
  measured / peak, so MFU stays relative to the spec-sheet peak);
- the smallest device memory replaces the preset's (on the CPU: the machine's, shared by the plan's
  processes).

A level with no measurement keeps the preset's figures, and the plan says so. Flags given on the
command line (--intra-node-gbps, --peak-tflops, --device-memory-gb, ...) win over the file.
Measured devices of another type than the preset's (a CPU doctor run for an H100 plan) are refused;
a different GPU model, node size or compute type is priced as measured with a warning line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratron.config.fields import flag
from paratron.errors import ConfigError
from paratron.planning.hardware import CPU, Hardware, ring_terms

FORMAT = "paratron-doctor/1"
REQUIRED = ("format", "world_size", "nodes", "ranks_per_node", "device_type", "devices", "compute", "collectives")
OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class LinkFit:
    """One network level's alpha-beta fit."""

    bandwidth_gbps: float
    """Bus bandwidth per device, GB/s (the ring's: bytes per step over the step's transfer time)."""
    latency_us: float
    """Start-up time of one message step, microseconds."""
    samples: int
    """Measurements fitted (sizes x collectives)."""
    operations: tuple[str, ...]
    group_sizes: tuple[int, ...]

    def describe(self) -> str:
        ops = ", ".join(o.replace("_", "-") for o in self.operations)
        ranks = "/".join(map(str, self.group_sizes))
        return (
            f"{self.bandwidth_gbps:.3g} GB/s, {self.latency_us:.3g} us per step "
            f"({self.samples} timings of {ops} over {ranks} ranks)"
        )


@dataclass(frozen=True)
class Calibration:
    """What a doctor.json measured, reduced to the figures a `Hardware` holds."""

    path: str
    world_size: int
    nodes: int
    ranks_per_node: int
    device_type: str
    device_names: tuple[str, ...]
    device_memory_gb: float | None
    matmul_tflops: float | None
    matmul_dtype: str | None
    intra_node: LinkFit | None
    inter_node: LinkFit | None


def device_memory_gb(calibration: Calibration, processes_per_machine: int) -> float | None:
    """One rank's memory as measured: the smallest device's, or on the CPU the machine's shared by its processes."""
    memory = calibration.device_memory_gb
    if memory is None or calibration.device_type != "cpu":
        return memory
    return memory / max(1, processes_per_machine)


def read_calibration(path: str | Path) -> Calibration:
    """doctor.json's figures; ConfigError (one line naming the file and the fix) when it is missing,
    not JSON, of another format, or lacks what the planner reads."""
    name = str(path)
    fix = "write it with paratron doctor --output FILE.json"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{flag.calibration} {name}: no such file; {fix}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag.calibration} {name}: cannot read it ({exc.__class__.__name__}); {fix}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag.calibration} {name}: not JSON (line {exc.lineno}: {exc.msg}); {fix}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{flag.calibration} {name}: not a doctor report (a JSON object); {fix}")
    if document.get("format") != FORMAT:
        found = document.get("format")
        raise ConfigError(
            f"{flag.calibration} {name}: format {found!r}, expected {FORMAT!r}; {fix} (with this version of paratron)"
        )
    missing = [key for key in REQUIRED if key not in document]
    if missing:
        raise ConfigError(f"{flag.calibration} {name}: no {', '.join(missing)}; {fix} (the whole report)")
    return _parse(name, document)


def _parse(name: str, document: Mapping[str, Any]) -> Calibration:
    """The figures of a report whose keys are all there; a value of the wrong type is a ConfigError."""
    try:
        devices = list(document["devices"])
        memories = [float(d["memory_gb"]) for d in devices if d.get("memory_gb")]
        compute = document["compute"] or {}
        tflops = compute.get("matmul_tflops")
        timings = [_timing(record) for record in document["collectives"]]
        return Calibration(
            path=name,
            world_size=int(document["world_size"]),
            nodes=int(document["nodes"]),
            ranks_per_node=int(document["ranks_per_node"]),
            device_type=str(document["device_type"]),
            device_names=tuple(str(d.get("name", "")) for d in devices),
            device_memory_gb=min(memories) if memories else None,
            matmul_tflops=float(tflops) if tflops else None,
            matmul_dtype=compute.get("dtype"),
            intra_node=fit_link(t for t in timings if not t["spans_nodes"]),
            inter_node=fit_link(t for t in timings if t["spans_nodes"]),
        )
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(
            f"{flag.calibration} {name}: a malformed entry ({exc.__class__.__name__}: {exc}); "
            "write it again with paratron doctor --output FILE.json"
        ) from None


def _timing(record: Mapping[str, Any]) -> dict[str, Any]:
    op = str(record["op"])
    if op not in OPERATIONS:
        raise ValueError(f"unknown collective {op!r}")
    timing = {
        "op": op,
        "group_size": int(record["group_size"]),
        "spans_nodes": bool(record["spans_nodes"]),
        "bytes": float(record["bytes"]),
        "time_us": float(record["time_us"]),
    }
    if timing["time_us"] <= 0 or timing["bytes"] <= 0:
        raise ValueError(f"{op} of {record['bytes']} bytes in {record['time_us']} us")
    return timing


def fit_link(timings: Iterable[Mapping[str, Any]]) -> LinkFit | None:
    """The alpha-beta fit (module docstring) of one level's timings; None when there are none.
    With a single size (no latency to tell apart) the latency is zero; a fit whose latency comes
    out negative keeps zero and fits the bandwidth alone."""
    rows = []
    for t in timings:
        if t["group_size"] < 2 and t["op"] != "send_recv":
            continue
        steps, chunk = ring_terms(t["op"], t["bytes"], t["group_size"])
        rows.append((steps, steps * chunk, t["time_us"] * 1e-6, t))
    if not rows:
        return None
    # time = steps x alpha + (steps x chunk) x (1 / beta), weighted by 1 / time (relative error)
    a11 = sum((s / t) ** 2 for s, _, t, _ in rows)
    a12 = sum(s * x / t**2 for s, x, t, _ in rows)
    a22 = sum((x / t) ** 2 for _, x, t, _ in rows)
    b1 = sum(s / t for s, _, t, _ in rows)
    b2 = sum(x / t for _, x, t, _ in rows)
    determinant = a11 * a22 - a12 * a12
    alpha, inverse_beta = -1.0, -1.0
    if determinant > 1e-12 * a11 * a22:
        alpha = (b1 * a22 - b2 * a12) / determinant
        inverse_beta = (a11 * b2 - a12 * b1) / determinant
    if alpha < 0 or inverse_beta <= 0:
        alpha, inverse_beta = 0.0, b2 / a22
    return LinkFit(
        bandwidth_gbps=1 / inverse_beta / 1e9,
        latency_us=alpha * 1e6,
        samples=len(rows),
        operations=tuple(sorted({r[3]["op"] for r in rows}, key=OPERATIONS.index)),
        group_sizes=tuple(sorted({r[3]["group_size"] for r in rows})),
    )


def calibrate(
    hardware: Hardware, calibration: Calibration, keep: Iterable[str] = (), precision: str | None = None
) -> tuple[Hardware, list[str]]:
    """`hardware` with the measured figures in place of the preset's (except the Hardware fields in
    `keep`: given on the command line), and lines that say which figures were measured, which were
    kept and why, and what does not match the plan. A CPU calibration for a GPU preset, or the other
    way round, is a ConfigError."""
    _check_device_type(hardware, calibration)
    kept = set(keep)
    changes: dict[str, float] = {}
    lines = [f"calibration {calibration.path}: measured on {_where(calibration)}"]
    for level, fit in (("intra_node", calibration.intra_node), ("inter_node", calibration.inter_node)):
        label = level.replace("_", "-")
        fields = (f"{level}_gbps", f"{level}_latency_us")
        if fit is None:
            why = "no group spanned nodes" if level == "inter_node" else "no collective within a node"
            lines.append(f"  {label}: the preset's {getattr(hardware, fields[0]):g} GB/s ({why})")
        elif kept.issuperset(fields):
            lines.append(f"  {label}: as given on the command line (measured: {fit.describe()})")
        else:
            changes |= {f: v for f, v in zip(fields, (fit.bandwidth_gbps, fit.latency_us)) if f not in kept}
            lines.append(f"  {label}: measured {fit.describe()}")
    lines.append(_compute(hardware, calibration, kept, changes))
    if calibration.device_memory_gb is None or "device_memory_gb" in kept:
        lines.append(f"  device memory: {hardware.device_memory_gb:g} GB, not from the file")
    elif hardware.name == CPU:  # (the doctor reports the machine's memory; the plan's processes share it)
        changes["device_memory_gb"] = device_memory_gb(calibration, hardware.gpus_per_node) or 0.0
        lines.append(
            f"  device memory: measured {calibration.device_memory_gb:.3g} GB per machine, "
            f"{changes['device_memory_gb']:.3g} GB for each of {hardware.gpus_per_node} processes"
        )
    else:
        changes["device_memory_gb"] = calibration.device_memory_gb
        lines.append(f"  device memory: measured {calibration.device_memory_gb:g} GB")
    lines += _mismatches(hardware, calibration, precision)
    return dataclasses.replace(hardware, **changes), lines


def _compute(hardware: Hardware, calibration: Calibration, kept: set[str], changes: dict[str, float]) -> str:
    """The matmul figure: achieved TFLOP/s = peak x efficiency (a figure above the peak raises the peak)."""
    measured = calibration.matmul_tflops
    if measured is None:
        return f"  compute: the preset's {hardware.flops / 1e12:.4g} TFLOP/s (no matmul measured)"
    if kept & {"peak_tflops", "matmul_efficiency"}:
        return f"  compute: as given on the command line (measured: {measured:.4g} TFLOP/s)"
    if measured > hardware.peak_tflops:
        changes |= {"peak_tflops": measured, "matmul_efficiency": 1.0}
    else:
        changes["matmul_efficiency"] = measured / hardware.peak_tflops
    return f"  compute: measured {measured:.4g} TFLOP/s dense matmul (the preset: {hardware.flops / 1e12:.4g})"


def _where(calibration: Calibration) -> str:
    names = sorted(set(calibration.device_names) - {""})
    devices = f" ({', '.join(names)})" if names else ""
    return (
        f"{calibration.world_size} ranks, {calibration.nodes} node(s) of {calibration.ranks_per_node}, "
        f"{calibration.device_type}{devices}"
    )


def _check_device_type(hardware: Hardware, calibration: Calibration) -> None:
    measured_cpu = calibration.device_type == "cpu"
    if measured_cpu != (hardware.name == CPU):
        wanted = "--hardware cpu" if measured_cpu else "a GPU preset (h100-80g, ...)"
        raise ConfigError(
            f"{flag.calibration} {calibration.path}: measured {calibration.device_type} devices, but the plan is for "
            f"--hardware {hardware.name}; run paratron doctor on the cluster the plan is for, or plan with {wanted}"
        )


def _mismatches(hardware: Hardware, calibration: Calibration, precision: str | None) -> list[str]:
    """Warning lines for what the file measured that differs from the plan's machine."""
    lines = []
    family = hardware.name.split("-")[0].upper()
    names = [n for n in calibration.device_names if n]
    if hardware.name != CPU and names and not all(family in n.upper() for n in names):
        lines.append(f"  warning: measured {names[0]}, the preset is {hardware.name}: its figures are replaced")
    if calibration.ranks_per_node != hardware.gpus_per_node:
        lines.append(
            f"  warning: measured {calibration.ranks_per_node} ranks per node, the plan has {hardware.gpus_per_node}"
        )
    dtype = PRECISIONS.get(str(calibration.matmul_dtype))
    if calibration.matmul_tflops is not None and precision and dtype and dtype != precision:
        lines.append(f"  warning: the matmul was timed in {dtype}, the plan trains in {precision}")
    if calibration.world_size < 2:
        lines.append("  warning: one rank measured no collective")
    return lines
