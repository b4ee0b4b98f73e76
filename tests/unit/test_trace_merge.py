"""--profile's merged timeline: ranks' Chrome traces as process rows of one, their clocks aligned."""

from __future__ import annotations

import json

import pytest

from paratron.debugging.trace import (
    FLOW_ID_STRIDE,
    PID_STRIDE,
    SYNC_MARK,
    TraceError,
    merge_traces,
    read_trace,
    write_merged,
)


def rank_trace(pid: int, start: float, host: str = "node0", base: int = 1_700_000_000_000_000_000) -> dict:
    """A small trace as torch.profiler writes it: metadata, the sync mark, two steps, a GPU row, a flow arrow."""
    return {
        "schemaVersion": 1,
        "host_name": host,
        "baseTimeNanoseconds": base,
        "displayTimeUnit": "ms",
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": "CPU"}},
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "args": {"name": "main"}},
            {"ph": "X", "name": SYNC_MARK, "pid": pid, "tid": pid, "ts": start, "dur": 1},
            {"ph": "X", "name": "ProfilerStep#2", "pid": pid, "tid": pid, "ts": start + 10, "dur": 100},
            {"ph": "X", "name": "ProfilerStep#3", "pid": pid, "tid": pid, "ts": start + 120, "dur": 100},
            {"ph": "X", "name": "gemm", "pid": 0, "tid": 7, "ts": start + 20, "dur": 30},
            {"ph": "s", "id": 5, "cat": "ac2g", "name": "launch", "pid": pid, "tid": pid, "ts": start + 15},
            {"ph": "f", "id": 5, "cat": "ac2g", "name": "launch", "pid": 0, "tid": 7, "ts": start + 20, "bp": "e"},
            {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": start + 300},
        ],
    }


def named(merged: dict, name: str) -> dict[int, float]:
    """The start of the event `name` on each process row."""
    return {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("name") == name}


def test_each_rank_is_a_named_process_row_and_keeps_its_clock_on_one_host():
    merged = merge_traces({0: rank_trace(4242, 1000.0), 1: rank_trace(4242, 1500.0)})
    rows = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert rows == {0: "rank 0", 1: "rank 0 GPU 0", PID_STRIDE: "rank 1", PID_STRIDE + 1: "rank 1 GPU 0"}
    assert merged["paratron"]["alignment"] == "host clock"
    assert named(merged, "ProfilerStep#2") == {0: 1010.0, PID_STRIDE: 1510.0}  # rank 1 started 500 us late
    assert named(merged, "gemm") == {1: 1020.0, PID_STRIDE + 1: 1520.0}
    flows = sorted((e["pid"], e["id"]) for e in merged["traceEvents"] if e["ph"] in ("s", "f"))
    assert flows == [(0, 5), (1, 5), (PID_STRIDE, 5 + FLOW_ID_STRIDE), (PID_STRIDE + 1, 5 + FLOW_ID_STRIDE)]
    ends = [e for e in merged["traceEvents"] if e["name"] == "Record Window End"]
    assert [(e["pid"], e["s"]) for e in ends] == [(0, "p"), (PID_STRIDE, "p")]  # on its rank's row only
    sort = {e["pid"]: e["args"]["sort_index"] for e in merged["traceEvents"] if e["name"] == "process_sort_index"}
    assert sort == {0: 0, 1: 1, PID_STRIDE: PID_STRIDE, PID_STRIDE + 1: PID_STRIDE + 1}


def test_ranks_on_several_hosts_are_aligned_on_the_barrier_mark():
    merged = merge_traces({0: rank_trace(11, 1000.0, "a"), 3: rank_trace(11, 90_000.0, "b")})
    assert merged["paratron"]["alignment"] == "barrier"
    assert merged["paratron"]["offsets_us"] == {"0": 0.0, "3": -89_000.0}
    assert named(merged, "ProfilerStep#3") == {0: 1120.0, 3 * PID_STRIDE: 1120.0}


def test_traces_without_the_mark_fall_back_to_the_wall_clock():
    later = rank_trace(11, 1000.0, "b", base=1_700_000_001_000_000_000)  # its base time one second later
    later["traceEvents"] = [e for e in later["traceEvents"] if e.get("name") != SYNC_MARK]
    merged = merge_traces({0: rank_trace(11, 1000.0, "a"), 1: later})
    assert merged["paratron"]["alignment"] == "wall clock"
    assert named(merged, "ProfilerStep#2") == {0: 1010.0, PID_STRIDE: 1_001_010.0}


def test_the_merged_file_is_written_whole_and_bad_traces_are_one_line_errors(tmp_path):
    out = write_merged({0: rank_trace(1, 0.0), 1: rank_trace(2, 0.0)}, tmp_path / "merged.json")
    assert json.loads(out.read_text())["paratron"]["ranks"] == [0, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["merged.json"]
    broken = tmp_path / "broken.json"
    broken.write_text('{"traceEvents": [')
    with pytest.raises(TraceError, match="broken.json: not a readable Chrome trace"):
        read_trace(broken)
    (tmp_path / "other.json").write_text('{"events": []}')
    with pytest.raises(TraceError, match="no traceEvents list"):
        read_trace(tmp_path / "other.json")
    with pytest.raises(TraceError, match="no trace to merge"):
        merge_traces({})


def test_rank_0_reads_the_traces_it_sees_and_is_sent_the_others(tmp_path, monkeypatch):
    """Two ranks without a shared disk, seen from rank 0: rank 1's path is not there, so its JSON comes
    over the default group (torch.distributed's calls stood in for)."""
    from paratron.training import profiling

    mine = tmp_path / "profile_rank0.json"
    mine.write_text(json.dumps(rank_trace(1, 0.0)))
    elsewhere = "/nonexistent/node1/profile_rank1.json"
    asked = []
    fake = profiling.dist
    monkeypatch.setattr(fake, "is_initialized", lambda: True)
    monkeypatch.setattr(fake, "get_world_size", lambda: 2)
    monkeypatch.setattr(fake, "get_rank", lambda: 0)

    def all_gather_object(out: list, obj: object) -> None:
        out[:] = [obj, elsewhere]

    def broadcast_object_list(objs: list, src: int) -> None:
        asked.append(list(objs[0]))

    def gather_object(obj: object, out: list, dst: int) -> None:
        out[:] = [obj, json.dumps(rank_trace(2, 5.0))]

    monkeypatch.setattr(fake, "all_gather_object", all_gather_object)
    monkeypatch.setattr(fake, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(fake, "gather_object", gather_object)
    traces = profiling.gather_traces(mine)
    assert asked == [[1]]  # rank 0 asked rank 1 alone to send its trace
    assert sorted(traces) == [0, 1]
    assert named(merge_traces(traces), "ProfilerStep#2") == {0: 10.0, PID_STRIDE: 15.0}
