"""One timeline of every profiled rank: --profile's per-rank Chrome traces merged into one file.

Each rank's trace becomes its own process rows: the host process that ran the steps is named
"rank R", its other processes (a GPU's streams) "rank R <their label>", all sorted by rank. Their
process ids are renumbered (rank x PID_STRIDE + k) and flow-arrow ids moved apart, so that no two
ranks share a row or an arrow.

Clocks. torch's trace times (`ts`, microseconds) are read from the host's monotonic clock, and
`baseTimeNanoseconds` is what turns them into wall-clock time, rounded to whole seconds. So:
- ranks on one host (the same `host_name`) share the clock: their times are taken as they are,
  which keeps real skew (a late rank's step starts late on the timeline);
- ranks on several hosts are aligned on SYNC_MARK, a zero-length range every profiled rank records
  as it leaves the barrier that opens the profiled steps (simultaneous up to the barrier's exit
  skew, whatever the hosts' clocks say);
- traces without the mark fall back to the wall clock (base time + ts), good to about a second.
The method used is recorded in the merged file's `paratron.alignment`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paratron.errors import UserError
from paratron.storage import replacing

SYNC_MARK = "paratron.profile_sync"
"""The range each profiled rank records right after the barrier that opens its profiled steps."""

PID_STRIDE = 100
"""Process ids of the merged trace: rank x PID_STRIDE + the process's position in its rank's trace."""

FLOW_ID_STRIDE = 1 << 40
"""Flow-arrow ids of rank R are moved up by R x this, apart from every other rank's."""

REPLACED_METADATA = {"process_name", "process_labels", "process_sort_index"}


class TraceError(UserError):
    """A trace to merge that cannot be read."""


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace file (a one-line error for a missing or damaged one)."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: not a readable Chrome trace ({exc}); write it again with --profile") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path}: no traceEvents list; a Chrome trace (torch.profiler's export) is expected")
    return trace


def mark_time(trace: dict[str, Any], name: str) -> float | None:
    """The start (ts) of the first event called `name`, if any."""
    times = [e["ts"] for e in trace["traceEvents"] if e.get("name") == name and e.get("ph") in ("X", "B", "i")]
    return min(times) if times else None


def alignment(traces: dict[int, dict[str, Any]]) -> tuple[str, dict[int, float]]:
    """How the ranks' times are aligned ("host clock", "barrier" or "wall clock") and the microseconds
    added to each rank's times to put them on the first rank's clock."""
    first = min(traces)
    hosts = {t.get("host_name") for t in traces.values()}
    if len(hosts) == 1 and None not in hosts:
        return "host clock", dict.fromkeys(traces, 0.0)
    marks = {rank: mark_time(t, SYNC_MARK) for rank, t in traces.items()}
    if all(m is not None for m in marks.values()):
        return "barrier", {rank: marks[first] - mark for rank, mark in marks.items()}
    base = {rank: float(t.get("baseTimeNanoseconds", 0)) / 1e3 for rank, t in traces.items()}
    return "wall clock", {rank: base[rank] - base[first] for rank in traces}


def merge_traces(traces: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace of every rank's (rank -> parsed trace), a process row per rank, clocks aligned."""
    if not traces:
        raise TraceError("no trace to merge: no profiled rank wrote one")
    method, offsets = alignment(traces)
    events: list[dict[str, Any]] = []
    for rank in sorted(traces):
        events.extend(_rank_events(rank, traces[rank]["traceEvents"], offsets[rank]))
    first = traces[min(traces)]
    return {
        "schemaVersion": first.get("schemaVersion", 1),
        "displayTimeUnit": first.get("displayTimeUnit", "ms"),
        "baseTimeNanoseconds": first.get("baseTimeNanoseconds", 0),
        "deviceProperties": first.get("deviceProperties", []),
        "paratron": {"ranks": sorted(traces), "alignment": method, "offsets_us": {str(r): offsets[r] for r in offsets}},
        "traceEvents": events,
    }


def _rank_events(rank: int, events: list[dict[str, Any]], offset: float) -> list[dict[str, Any]]:
    """One rank's events moved onto the merged timeline: renumbered processes named after the rank,
    times shifted by `offset`, flow ids apart from other ranks'."""
    pids = _process_ids(rank, events)
    labels = {
        e.get("pid"): e.get("args", {}).get("labels") or e.get("args", {}).get("name")
        for e in events
        if e.get("ph") == "M" and e.get("name") in ("process_name", "process_labels")
    }
    out = []
    named: set[int] = set()
    for old, new in pids.items():
        if new in named:
            continue
        named.add(new)
        name = f"rank {rank}" if new == rank * PID_STRIDE else f"rank {rank} {labels.get(old) or old}"
        out.append({"ph": "M", "name": "process_name", "pid": new, "tid": 0, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": new, "tid": 0, "args": {"sort_index": new}})
    for event in events:
        if event.get("ph") == "M" and event.get("name") in REPLACED_METADATA:
            continue
        moved = dict(event, pid=pids[event.get("pid")])
        if isinstance(moved.get("ts"), (int, float)):
            moved["ts"] = moved["ts"] + offset
        if "id" in moved and moved.get("ph") in ("s", "t", "f"):
            moved["id"] = (
                moved["id"] + rank * FLOW_ID_STRIDE if isinstance(moved["id"], int) else f"{rank}:{moved['id']}"
            )
        if moved.get("ph") == "i" and moved.get("s") == "g":  # (a global instant would cross every rank's rows)
            moved["s"] = "p"
        out.append(moved)
    return out


def _process_ids(rank: int, events: list[dict[str, Any]]) -> dict[Any, int]:
    """Each process id of a rank's trace renumbered rank x PID_STRIDE + k, the host's k = 0. The
    profiler's named pseudo-processes ("Spans", "Traces": its own markers) join the host's row."""
    order: list[Any] = []
    host = _host_pid(events)
    if host is not None:
        order.append(host)
    for event in events:
        pid = event.get("pid")
        if isinstance(pid, int) and pid not in order:
            order.append(pid)
    if len(order) > PID_STRIDE:
        raise TraceError(f"rank {rank}'s trace has {len(order)} processes; at most {PID_STRIDE} can be merged")
    numbers = {pid: rank * PID_STRIDE + k for k, pid in enumerate(order)}
    return {e.get("pid"): numbers.get(e.get("pid"), rank * PID_STRIDE) for e in events} | numbers


def _host_pid(events: list[dict[str, Any]]) -> Any:
    """The process that ran the steps: the one with the ProfilerStep# ranges (else the first numbered one)."""
    for event in events:
        if str(event.get("name", "")).startswith("ProfilerStep#"):
            return event.get("pid")
    return next((e.get("pid") for e in events if isinstance(e.get("pid"), int)), None)


def write_merged(traces: dict[int, dict[str, Any]], path: Path) -> Path:
    """Merge the ranks' traces into `path` (written whole or not at all)."""
    merged = merge_traces(traces)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        Path(tmp).write_text(json.dumps(merged))
    return path
