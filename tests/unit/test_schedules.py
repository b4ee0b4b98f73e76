"""Pipeline schedules as data: completeness, bubbles against the closed forms, memory, deadlocks,
and the pictures drawn from them."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from paratron.parallel.pipeline.draw import draw_timeline, write_chrome_trace
from paratron.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    peak_live_activations,
    simulate,
    theoretical_bubble,
)
from paratron.parallel.pipeline.timing import flatten, rank_times

PIPELINE_SIZES = (1, 2, 3, 4, 8)
MICROBATCHES = range(1, 17)


def grid(name: str, pp: int) -> list[tuple[int, int]]:
    """(micro-batches, chunks) the schedule accepts at this pipeline size."""
    if name == "interleaved":
        return [(m, v) for m in MICROBATCHES if m % pp == 0 for v in (1, 2, 3)]
    if name == "zb-v":
        return [(m, 2) for m in MICROBATCHES]  # always two chunks per rank, in a V
    return [(m, 1) for m in MICROBATCHES]


def bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    return simulate(build_schedule(name, pp, m, v)).bubble_fraction()


@pytest.mark.parametrize("pp", PIPELINE_SIZES)
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_rank_runs_every_operation_once_without_deadlock(name, pp):
    kinds = "FBW" if name.startswith("zb-") else "FB"
    for m, v in grid(name, pp):
        schedule = build_schedule(name, pp, m, v)
        timeline = simulate(schedule)
        expected = Counter(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))  # type: ignore[arg-type]
        for rank in range(pp):
            assert Counter(a for a, _, _ in timeline.spans[rank]) == expected, (name, pp, m, v, rank)
            assert [a for a, _, _ in timeline.spans[rank]] == schedule.ranks[rank]
            starts = [s for _, s, _ in timeline.spans[rank]]
            assert starts == sorted(starts)  # a rank runs one operation at a time, in its list's order
        assert timeline.makespan == max(e for row in timeline.spans for _, _, e in row)


@pytest.mark.parametrize("pp", PIPELINE_SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_simulated_bubble_matches_closed_form(name, pp):
    checked = 0
    for m, v in grid(name, pp):
        if m >= pp:
            assert bubble(name, pp, m, v) == pytest.approx(theoretical_bubble(name, pp, m, v), abs=1e-9), (pp, m, v)
            checked += 1
    assert checked > 0


def test_closed_forms_at_known_points():
    assert bubble("1f1b", 4, 8) == pytest.approx(3 / 11, abs=1e-12)
    assert bubble("gpipe", 4, 8) == pytest.approx(3 / 11, abs=1e-12)
    assert bubble("interleaved", 4, 8, 2) == pytest.approx(1.5 / 9.5, abs=1e-12)
    assert bubble("zb-h1", 4, 8) == pytest.approx(3 / 27, abs=1e-12)
    assert bubble("1f1b", 1, 5) == 0.0


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_beats_1f1b(pp):
    for m in range(pp, 17):
        assert bubble("zb-h1", pp, m) < bubble("1f1b", pp, m), (pp, m)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_v_beats_zb_h1_with_1f1b_memory(pp):
    """ZB-V's V of two chunks per rank leaves less bubble than ZB-H1 once micro-batches reach
    twice the stages (as little at an odd pipeline size), and holds at most 2 pp half-stage
    chunks on every rank (1F1B's first rank)."""
    for m in range(2 * pp, 17):
        if pp % 2:
            assert bubble("zb-v", pp, m) <= bubble("zb-h1", pp, m) + 1e-12, (pp, m)
        else:
            assert bubble("zb-v", pp, m) < bubble("zb-h1", pp, m), (pp, m)
        assert max(peak_live_activations(build_schedule("zb-v", pp, m))) <= 2 * pp


def test_zb_v_places_chunks_as_a_v():
    schedule = build_schedule("zb-v", 4, 8)
    assert [schedule.stage(r, c) for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(schedule.place(schedule.stage(r, c)) == (r, c) for r in range(4) for c in (0, 1))


@pytest.mark.parametrize("pp", PIPELINE_SIZES)
def test_peak_live_activations(pp):
    for m in MICROBATCHES:
        assert peak_live_activations(build_schedule("1f1b", pp, m)) == [min(pp - r, m) for r in range(pp)]
        assert peak_live_activations(build_schedule("gpipe", pp, m)) == [m] * pp
        assert peak_live_activations(build_schedule("zb-h1", pp, m)) == [min(pp - r, m) for r in range(pp)]


def test_1f1b_order():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    expected = [F(0), F(1), F(2), F(3), B(0), F(4), B(1), F(5), B(2), F(6), B(3), F(7), B(4), B(5), B(6), B(7)]
    schedule = build_schedule("1f1b", 4, 8)
    assert schedule.ranks[0] == expected
    assert schedule.ranks[3] == [a for i in range(8) for a in (F(i), B(i))]
    assert str(schedule).splitlines()[3] == "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_deadlock_is_reported():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    # Rank 0 waits for B0 from rank 1, which first waits for F1 that rank 0 only sends after B0.
    schedule = Schedule("1f1b", 2, 2, ranks=[[F(0), B(0), F(1), B(1)], [F(1), B(1), F(0), B(0)]])
    with pytest.raises(ValueError, match="deadlocks: rank 0 at B0, rank 1 at F1"):
        simulate(schedule)


def test_missing_operation_is_reported():
    schedule = build_schedule("1f1b", 2, 3)
    schedule.ranks[1].pop()
    with pytest.raises(ValueError, match="rank 1 does not run every operation exactly once"):
        simulate(schedule)


def test_invalid_schedules_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual stages need 'interleaved'"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("pipedream", 4, 8)


def test_draw_timeline_writes_png(tmp_path):
    simulated = simulate(build_schedule("interleaved", 4, 8, 2))
    path = draw_timeline(simulated.spans, tmp_path / "sim.png", "interleaved", "(forward = 1)")
    assert path == tmp_path / "sim.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    # Measured spans: milliseconds from some clock, not starting at zero.
    measured = [
        [(a, 1000.0 + 3 * s, 1000.0 + 3 * e) for a, s, e in row]
        for row in simulate(build_schedule("zb-h1", 2, 4)).spans
    ]
    out = draw_timeline(measured, tmp_path / "deep" / "run.png", "measured", "(ms)")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["run.png", "sim.png"]  # no temp files


def test_chrome_trace(tmp_path):
    spans = {
        r: [(a, 2.0 * s, 2.0 * e) for a, s, e in row]
        for r, row in enumerate(simulate(build_schedule("interleaved", 2, 4, 2)).spans)
    }
    path = write_chrome_trace(tmp_path / "trace.json", spans)
    events = json.loads(path.read_text())["traceEvents"]
    ops = [e for e in events if e["ph"] == "X"]
    assert len(ops) == 2 * 2 * 4 * 2  # ranks x (F, B) x micro-batches x chunks
    assert Counter(e["tid"] for e in ops) == {0: 16, 1: 16}
    assert {e["pid"] for e in events} == {0}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "pipeline rank 0", 1: "pipeline rank 1"}
    first = ops[0]
    assert (first["name"], first["cat"], first["ts"], first["dur"]) == ("F0", "F", 0.0, 1000.0)  # F: 0.5 units x 2 ms
    backward = next(e for e in ops if e["name"] == "B0.1")
    assert backward["cat"] == "B" and backward["dur"] == pytest.approx(2000.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


# ---------------------------------------------------------------- the flattened schedule (timing.py)


@pytest.mark.parametrize("name", SCHEDULES)
def test_flat_rank_times_equal_simulate_bit_for_bit(name):
    rng = random.Random(SCHEDULES.index(name))
    for pp in (1, 2, 3, 4):
        for m, v in grid(name, pp)[::5]:
            schedule = build_schedule(name, pp, m, v)
            flat = flatten(schedule)
            for latency in (0.0, 0.37):
                costs = [tuple(rng.uniform(0.1, 3.0) for _ in "FBW") for _ in range(schedule.num_stages)]
                timeline = simulate(schedule, stage_costs=[dict(zip("FBW", c)) for c in costs], p2p_latency=latency)
                finish, busy = rank_times(flat, costs, latency)
                assert finish == [spans[-1][2] for spans in timeline.spans]  # (exact: the same sums in order)
                assert busy == [in_order(schedule, r, costs) for r in range(pp)]
                assert busy == pytest.approx([timeline.busy(r) for r in range(pp)])


def in_order(schedule: Schedule, rank: int, costs: list[tuple[float, ...]]) -> float:
    """A rank's busy time as `simulate` adds it: its operations' durations one after another."""
    total = 0.0
    for action in schedule.ranks[rank]:
        total += costs[schedule.stage(rank, action.chunk)]["FBW".index(action.kind)]
    return total


def test_flat_schedule_refuses_deadlocks_and_wrong_costs():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    schedule = Schedule("1f1b", 2, 2, ranks=[[F(0), B(0), F(1), B(1)], [F(1), B(1), F(0), B(0)]])
    with pytest.raises(ValueError, match="deadlocks: rank 0 at B0, rank 1 at F1"):
        flatten(schedule)
    with pytest.raises(ValueError, match="stage_costs has 3 entries for 4 model stages"):
        rank_times(flatten(build_schedule("1f1b", 4, 8)), [(1.0, 2.0, 0.0)] * 3)


def test_zero_bubble_orders_are_pinned():
    """The generated orders (the planner's plans depend on them) for a small case of each."""
    assert str(build_schedule("zb-h1", 3, 4)).splitlines() == [
        "rank 0: F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "rank 1: F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        "rank 2: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ]
    assert [s.split() for s in str(build_schedule("zb-v", 2, 3)).splitlines()] == [
        "rank 0: F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 B0 W1.1 B1 W0 W1 F2.1 B2.1 W2.1 B2 W2".split(),
        "rank 1: F0 F0.1 F1 F1.1 B0.1 B0 W0.1 B1.1 B1 W1.1 F2 F2.1 W0 W1 B2.1 B2 W2.1 W2".split(),
    ]
